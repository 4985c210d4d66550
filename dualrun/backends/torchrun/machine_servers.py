"""Multi-machine torchrun: a separate role's servers on several machines, wired through torchrun's agent store.

Why: machines started by hand do not talk before the job, and a role's replicas may run on any of them (the plan
fills machine 0's free GPUs first, then machine 1's, ...). Each machine's launcher starts and watches its own
servers before its torchrun agent; then, beside the agent, `Machines.share` runs in a thread:
- machine K >= 1 publishes the address of each server it runs (`job_store.SERVER_KEY`);
- machine 0 reads the others' addresses, starts the routers in front of every replica (watched and stopped
  with its other servers), and publishes the trainers' wiring env (`job_store.WIRING_KEY`), the same for
  every machine. Every rank reads it before the user's program starts (dualrun/rank/store_wiring.py), so no
  rank uses the router's address before it answers for every replica.
Machine 0 also health-checks the other machines' servers while the job runs (`Machines.check`), so a replica
that dies on machine K ends the job there (its launcher watches the process) and on machine 0 within seconds —
unless machine K restarts it (`replica_restarts`: its own budget; it hands the fresh address to machine 0's router,
whose address it read from the store, and machine 0's check follows the router's table meanwhile);
machine K health-checks machine 0's routers the same way (machine 0 publishes their addresses too), so machine 0
or its router dying ends machine K's job instead of leaving its ranks waiting in a collective. Each machine says
when its ranks finished (`Machines.finish`) so that its servers' normal end is no failure. The store is the
one at `main_process_ip:main_process_port` (static rendezvous: the agent store; c10d: the rendezvous store).
`Machines` is the multi-machine wrapper around this machine's `LocalServers`, and the one place that knows there
are several machines: where the servers bind and are advertised (`machine_endpoint`), that the ranks read their
wiring from the store, that a replica's last-replica rule asks its router (another machine's replica may be down),
the exchange, and the health checks of the other machines' servers; the misses are the supervisor's table's
(supervision.py), and a death it finds is reported to the set like any other. It is a server set itself
(serverset.ServerSet): the launcher uses it in the machine's `LocalServers`' place. A machine without trainer
ranks (the trainers' `roles.<name>.machines` leaves it out) uses it the same way, with no torchrun agent beside it
(launchers/serve_only.py).
"""
from __future__ import annotations

import json
import sys
import threading
import time

from dualrun.contract import job_store, protocol
from dualrun.plan.processes import ROUTER, Plan
from dualrun.programs.rotation import PROBE_TIMEOUT_S
from dualrun.servers.local import Endpoint, LocalServers
from dualrun.servers.planned import facing
from dualrun.servers.process import ServerError
from dualrun.servers.serverset import ServerDeath
from dualrun.servers.supervision import liveness_path, restartable, restarting, router_of

PROBE_EVERY_S = 1.0   # how often another machine's server is health-checked
CONNECT_S = 1.0       # ... how long its machine may take to accept the check's connection (the answer: the router's)


def others(plan: Plan, machine: int) -> list[int]:
    """plan.servers indices of the servers other machines run."""
    return [i for i, p in enumerate(plan.servers) if p.node != machine]


BIND = "0.0.0.0"   # where the servers of a job across machines listen: every address (the others reach them)


def machine_endpoint(main: str, machine: int) -> Endpoint:
    """Where a machine's servers bind (every address) and the host machine 0 (`main`) reaches them at."""
    from dualrun.light.ports import route_address

    return Endpoint(BIND, main if machine == 0 else route_address(main))


class Machines:
    """This machine's side of a multi-machine job's servers, around its `LocalServers` (`servers`), through the
    store at `host:port` (machine 0's address): the exchange (`share`), the health checks of the other machines'
    servers (`check`, `settle`), and the marks of a machine that finished (`finish`) or whose servers never
    started (`not_started`). The rest of the server-set interface is the local set's."""

    def __init__(self, servers: LocalServers, host: str, port: int, attempt: int = 0, token: str = "") -> None:
        self.servers, self.host, self.port, self.attempt = servers, host, port, attempt
        self.token = token   # machine 0: the secret it hands the others (`take_token`); "": the user gave one
        self.plan = servers.plan
        self.machine = self.plan.machine_rank or 0
        self.watched: dict[int, str] = {}    # another machine's server health-checked from here -> its address
        self.restartable = restartable(self.plan)   # every machine's replicas that are restarted at all
        gone_is_finished = self.machine == 0
        self.finished_elsewhere = lambda machine: _finished(host, port, machine, gone_is_finished)   # it said so
        self._next_probe = 0.0
        self._probe_lock = threading.Lock()
        servers.endpoint = machine_endpoint(host, self.machine)
        servers.supervisor.others_serving = self._others_serving

    # -- the server-set interface: the local set's, but for the ranks' wiring ------------------------------------
    @property
    def addresses(self) -> dict[str, str]:
        return self.servers.addresses

    @property
    def failure(self) -> ServerDeath | None:
        return self.servers.failure

    @property
    def watching(self) -> bool:
        return self.servers.watching

    @property
    def stopping(self) -> bool:
        return self.servers.stopping

    def start(self) -> dict[str, str]:
        return self.servers.start()

    def reserve(self) -> None:
        """Several machines start their servers first: their addresses meet in the store once each answers."""
        return None

    @property
    def start_error(self) -> Exception | None:
        return None

    def wiring_env(self) -> dict[str, str]:
        """Only that the ranks read their wiring from the store, where machine 0's launcher puts it once every
        machine's servers answer (`share`)."""
        return {protocol.WIRING_FETCH: f"{self.host}:{self.port}"}

    def used(self) -> frozenset[str]:
        return self.servers.used()

    def watch(self) -> None:
        self.servers.watch()

    def unwatch(self) -> None:
        self.servers.unwatch()

    def report(self, death: ServerDeath) -> None:
        self.servers.report(death)

    def next_death(self, timeout: float = 0.0) -> ServerDeath | None:
        return self.servers.next_death(timeout)

    def stop(self, grace_s: float = 10.0) -> None:
        self.servers.stop(grace_s)

    def __enter__(self) -> "Machines":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def own(self) -> dict[int, str]:
        """plan.servers index -> advertised address, of the servers this machine runs."""
        return {i: a for i, a in self.servers.started.items() if i in self.servers.mine}

    def _others_serving(self, index: int) -> bool:
        """The last-replica rule needs the router's view (machine 0's; machine K learns its address from the
        store): another replica of the role is in rotation there."""
        from dualrun.servers import router_client

        router, slot = router_of(self.plan, index)
        at = self.servers.started.get(router)
        if at is None:
            return False   # died before its router answered: the job ends
        try:
            return any(i != slot for i in router_client.replicas(at, timeout_s=2.0)["in_rotation"])
        except (OSError, ValueError, KeyError):
            return False

    def share(self) -> threading.Thread:
        """Run the exchange above in a daemon thread (the store exists once torchrun's agent rendezvous begins),
        and health-check the other machines' servers while the set is watched. A router that fails, or an
        address that never comes, is reported to the set as a death."""
        thread = threading.Thread(target=self._exchange, name="dualrun-server-wiring", daemon=True)
        thread.start()
        threading.Thread(target=self._probe_loop, name="dualrun-server-probe", daemon=True).start()
        return thread

    def _exchange(self) -> None:
        servers, plan = self.servers, self.servers.plan
        try:
            store = job_store.connect(self.host, self.port, _wait_s(servers))
            if self.machine == 0:
                store.set(job_store.TOKEN_KEY, self.token)   # the others' servers wait for it (`take_token`)
                store.set(job_store.ATTEMPT_KEY, str(self.attempt))   # this store serves that attempt (`await_attempt`)
            for index, address in self.own().items():
                store.set(job_store.server_key(index), address)
                if self.machine != 0:
                    print(f"dualrun: {plan.servers[index].label}: server healthy at {address} (machine "
                          f"{self.machine}), handed to machine 0", file=sys.stderr, flush=True)
            if self.machine != 0:   # watch the servers the ranks talk to that run elsewhere (`check`)
                self.watched.update({i: self._address(i, store.get(job_store.server_key(i)).decode())
                                     for i in facing(plan) if plan.servers[i].node != self.machine})
                # the routers' addresses: a replica restarted here is handed to its router there (supervisor.py)
                servers.started.update({i: a for i, a in self.watched.items() if plan.servers[i].kind == ROUTER})
                return
            remote = {i: self._address(i, store.get(job_store.server_key(i)).decode())
                      for i in others(plan, self.machine)}
            self.watched.update(remote)
            servers.started.update(remote)
            done = servers.start_now([i for i in servers.mine if i not in servers.started])
            if done is None:
                return   # stopped meanwhile
            for index, address in done.items():
                store.set(job_store.server_key(index), address)   # the other machines watch it
                print(f"dualrun: {plan.servers[index].unit}: server healthy at {address}", file=sys.stderr, flush=True)
            store.set(job_store.WIRING_KEY, json.dumps(servers.wiring_env()))
            # the thread that started the routers stays until they stop: a server dies with the thread that
            # spawned it (PR_SET_PDEATHSIG, dualrun.light.parent_death)
            servers.wait_stopped()
        except ServerError as e:
            servers.report(ServerDeath.of(None, e))
        except Exception as e:  # noqa: BLE001 - the store went away or a key never came: name it, end the job
            servers.report(ServerDeath.of(None, ServerError(
                "the servers' wiring", f"could not be shared through torchrun's store at {self.host}:{self.port}: "
                f"{type(e).__name__}: {e}")))

    def _address(self, index: int, value: str) -> str:
        if value.startswith(job_store.FAILED):
            proc = self.servers.plan.servers[index]
            raise ServerError(proc.label, f"did not start on machine {proc.node}: {value[len(job_store.FAILED):]}")
        return value

    # -- health checks of the other machines' servers ---------------------------------------------------------
    def check(self) -> ServerDeath | None:
        """One look at this machine's servers and, about once a second, a health check of every other machine's
        server watched from here: two misses in a row are a death (their own machine's launcher names the exit
        code). The set's `failure`."""
        if self.servers.check() is None and time.monotonic() >= self._next_probe:
            self._next_probe = time.monotonic() + PROBE_EVERY_S
            error = self._probe()
            if error is not None:
                self.servers.report(error)
        return self.servers.failure

    def _probe(self) -> ServerDeath | None:
        """One health check of each watched server, as the router checks a replica: `PROBE_TIMEOUT_S` to answer
        (a server busy on a loaded machine is not lost), `CONNECT_S` to accept the connection (a live machine's
        kernel accepts at once, so a lost machine or a dead server is found as fast as before), and a router's
        table, not its `/health` (503 while its replicas are out, which is their state, not the router's)."""
        with self._probe_lock:
            urls = {index: f"http://{address}{liveness_path(self.plan, index)}"
                    for index, address in list(self.watched.items())}
            for index, (ok, detail) in probe_all(urls).items():
                proc, url = self.plan.servers[index], urls[index]
                answered = ok or self._being_restarted(index)
                if self.servers.supervisor.checked(index, answered) and not self.finished_elsewhere(proc.node):
                    return ServerDeath.of(index, ServerError(
                        proc.label, f"on machine {proc.node} stopped answering its health check ({url}: {detail}) "
                        "while the job was running (that machine's launcher, if it is alive, names its exit)"))
        return None

    def _being_restarted(self, index: int) -> bool:
        """Machine 0: whether another machine's replica that missed a health check is being restarted by its own
        machine (`replica_restarts`): its router here has it out for the launcher (`remove`) or joining at a fresh
        address (`supervision.restarting`), which is watched from then on. A replica its machine does not restart
        stays a death."""
        from dualrun.servers import router_client

        if index not in self.restartable:
            return False
        router, slot = router_of(self.plan, index)
        if router not in self.servers.started:
            return False
        try:
            row = router_client.replicas(self.servers.started[router], timeout_s=2.0)["replicas"][slot]
        except (OSError, ValueError, KeyError, IndexError):
            return False
        if row.get("address") and row["address"] != self.watched[index]:
            self.watched[index] = row["address"]   # the restarted one, healthy before its router took it
            return True
        return restarting(row)

    def _probe_loop(self) -> None:
        while not self.servers.stopping and self.servers.failure is None:
            if self.servers.watching:
                self.check()
            time.sleep(0.25)

    def settle(self) -> ServerDeath | None:
        """`check` once the ranks failed: another machine's server that just missed a health check gets its second
        look now (about a second), so a dead router is named as the cause, not the ranks that failed for it."""
        self._next_probe = 0.0
        while self.check() is None and self.servers.supervisor.missing:
            time.sleep(PROBE_EVERY_S)
            self._next_probe = 0.0
        return self.servers.failure

    # -- marks in the store -------------------------------------------------------------------------------------
    def not_started(self, error: str) -> None:
        """Machine K >= 1 whose servers did not start: put the reason where machine 0 waits for their addresses,
        so it ends the job too (naming them) instead of waiting for addresses that never come. Best effort:
        machine 0's store may not be up yet (waited for a minute)."""
        mine = self.servers.mine
        if self.machine == 0 or not mine:
            return
        line = next((ln for ln in error.splitlines() if ln.strip()), "no message")
        try:
            store = job_store.connect(self.host, self.port, 60.0)
            for index in mine:
                store.set(job_store.server_key(index), job_store.FAILED + line)
        except Exception:  # noqa: BLE001 - no store: machine 0 is not running; this machine's error is named anyway
            pass

    def finish(self) -> None:
        """A machine whose ranks are done: say so before its servers stop, so that the machines watching them do
        not take their end for a death. The store may be gone already (it ends with machine 0's torchrun agent):
        then every machine's ranks passed torchrun's exit barrier, and each machine's watch ends as its own agent
        returns."""
        if not self.own() or not job_store.listening(self.host, self.port):
            return
        try:
            job_store.connect(self.host, self.port, 5.0).set(job_store.finished_key(self.machine), "1")
        except Exception:  # noqa: BLE001 - no store left: nobody watches this machine's servers any more
            pass


def probe_all(urls: dict[int, str]) -> dict[int, tuple[bool, str]]:
    """`process.probe` of every url at once (as the router probes its replicas): a server that hangs costs the round
    its own bound, not every server after it its bound as well. Same keys, same order."""
    from concurrent.futures import ThreadPoolExecutor

    from dualrun.servers.process import probe

    if len(urls) <= 1:
        return {index: probe(url, PROBE_TIMEOUT_S, connect_s=CONNECT_S) for index, url in urls.items()}
    with ThreadPoolExecutor(len(urls), thread_name_prefix="dualrun-probe") as pool:
        pending = {index: pool.submit(probe, url, PROBE_TIMEOUT_S, connect_s=CONNECT_S) for index, url in urls.items()}
        return {index: future.result() for index, future in pending.items()}


def await_attempt(host: str, port: int, attempt: int, timeout_s: float = job_store.WAIT_S) -> None:
    """Machine K >= 1, before its restart `attempt`: wait while the store at `host:port` is still the ending
    attempt's (machine 0 restarts too, on the same port, once its agent has stopped), so that neither this machine's
    addresses nor its torchrun agent go to a store about to vanish. Returns once it is gone or marked `attempt`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and job_store.listening(host, port):
        try:
            store = job_store.connect(host, port, 2.0)
            if store.check([job_store.ATTEMPT_KEY]) and int(store.get(job_store.ATTEMPT_KEY)) >= attempt:
                return
        except Exception:  # noqa: BLE001 - the store went away meanwhile: the next look sees it gone
            pass
        time.sleep(0.5)


def take_token(host: str, port: int, machine: int, timeout_s: float) -> str:
    """Machine K >= 1 with no DUALRUN_JOB_TOKEN of its own, before its servers start: the secret machine 0 made, from
    its store at `host:port` (machine 0 puts it there once its agent's store listens: `Machines._exchange`), so the
    servers here refuse whoever lacks it. LaunchError when machine 0 does not hand it over within `timeout_s`, or
    set DUALRUN_JOB_TOKEN itself (that one is not handed out: every machine needs the same)."""
    from dualrun.contract.errors import LaunchError

    try:
        value = job_store.connect(host, port, timeout_s).get(job_store.TOKEN_KEY).decode()
    except Exception as e:  # noqa: BLE001 - no store, or no key, within the bound: machine 0 is not there
        raise LaunchError(
            f"machine 0 ({host}) did not hand over the job's secret within {timeout_s:g} s "
            f"(torchrun.rendezvous_timeout_s; its store at {host}:{port}, main_process_ip and main_process_port): it "
            f"is not started, has ended, or this machine cannot reach it ({type(e).__name__})") from None
    if not value:
        raise LaunchError(f"{protocol.JOB_TOKEN}: expected the same value on every machine, got unset on machine "
                          f"{machine} while machine 0 has one (set it on every machine, or on none)", 2)
    return value


def _finished(host: str, port: int, machine: int, gone_is_finished: bool) -> bool:
    """Whether `machine` said its ranks finished. A store that is gone means this machine's own agent ended on
    machine 0 (`gone_is_finished`), but machine 0's end on machine K: silence there is a failure."""
    if not job_store.listening(host, port):
        return gone_is_finished
    try:
        return job_store.connect(host, port, 2.0).check([job_store.finished_key(machine)])
    except Exception:  # noqa: BLE001 - the store went away meanwhile: as above
        return gone_is_finished


def _wait_s(servers: LocalServers) -> float:
    """How long a key may take: another machine starts by hand, then waits for its own servers' health."""
    timeouts = [p.serving.health_timeout_s for p in servers.plan.servers if p.serving is not None]
    return job_store.WAIT_S + max(timeouts, default=0.0)
