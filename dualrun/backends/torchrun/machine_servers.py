"""Multi-machine torchrun: a separate role's servers on several machines, wired through torchrun's agent store.

Why: machines started by hand do not talk before the job, and a role's replicas may run on any of them (the plan
fills machine 0's free GPUs first, then machine 1's, ...). The servers start beside the trainers, as on one machine:
each machine picks its servers' ports first (`reserve`: machine 0 its routers' too) and, beside its torchrun
agent, `Machines.share` runs the exchange in a thread:
- every machine publishes those addresses at once (`job_store.RESERVED_KEY`); machine 0 publishes the trainers'
  wiring env (`job_store.WIRING_KEY`, with `DUALRUN_SERVERS_STARTING`), which every rank reads before the user's
  program starts (dualrun/rank/store_wiring.py) and waits at where it first connects (dualrun/rank/server_wait.py);
- each machine's start thread (`start`) marks each server once it answered (`job_store.SERVER_KEY`), or names the
  one that did not (`FAILED`, `not_started`: every machine ends); machine 0 starts its routers once every other
  machine's replica answered.
From a server's answer on, machine 0 health-checks the other machines' replicas (`check`) and they its routers, so
a death anywhere ends the job on every machine within seconds, instead of leaving ranks waiting in a collective —
unless the replica's machine restarts it (`replica_restarts`: it hands the fresh address to machine 0's router,
whose table machine 0's check follows meanwhile). Each machine says when its ranks finished (`finish`) so that its
servers' normal end is no failure.

The store is the one at `main_process_ip:main_process_port` (static rendezvous: the agent store; c10d: the
rendezvous store). `Machines`, a server set itself (serverset.ServerSet) that the
launcher uses in the machine's `LocalServers`' place, is the one place that knows there are several machines: where
the servers bind and are advertised (`machine_endpoint`), that the ranks read their wiring from the store, that a
replica's last-replica rule asks its router, the exchange and the health checks (their misses are the supervisor's
table's, supervision.py). A machine without trainer ranks uses it the same way, with no torchrun agent beside it
(serve_only.py).
"""
from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

from dualrun.backends.torchrun.machine_fleet import MachineFleet, offer
from dualrun.backends.torchrun.machine_store import await_attempt, take_token  # noqa: F401 - their old home
from dualrun.contract import job_store, protocol
from dualrun.contract.errors import LaunchError
from dualrun.plan.optional import joining, optional_machines
from dualrun.plan.processes import ROUTER, Plan
from dualrun.programs.rotation import PROBE_TIMEOUT_S
from dualrun.servers.local import Endpoint, LocalServers
from dualrun.servers.planned import addresses, at_launch, facing
from dualrun.servers.process import ServerError
from dualrun.servers.serverset import ServerDeath
from dualrun.servers.supervision import liveness_path, restartable, restarting, router_of

PROBE_EVERY_S = 1.0   # how often another machine's server is health-checked
CONNECT_S = 1.0       # ... how long its machine may take to accept the check's connection (the answer: the router's)


def others(plan: Plan, machine: int) -> list[int]:
    """plan.servers indices of the servers other machines run at the job's start (not an optional machine's)."""
    later = joining(plan)
    return [i for i, p in enumerate(plan.servers) if p.node != machine and i not in later]


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
        self.reserved: dict[int, str] = {}   # index -> address of this machine's servers, picked before they start
        self._answered: set[int] = set()     # this machine's servers published as answered (`SERVER_KEY`)
        self._marked = False                  # this machine's start failure is in the store (`not_started`)
        self._ranks_ended = False             # the job's ranks ended here (`unwatch`): the store may close
        self._others_known = threading.Event()   # machine 0: every other machine's replica answered, or never will
        servers.endpoint = machine_endpoint(host, self.machine)
        servers.supervisor.others_serving = self._others_serving
        self.optional = optional_machines(self.plan)   # machines that come and go (machine_fleet.py)
        self.fleet = MachineFleet(self, self.optional) if self.machine == 0 and self.optional else None

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

    @property
    def fleet_history(self) -> list[str]:   # the job's summary: replicas that joined and left with their machine
        return self.servers.fleet_history

    def reserve(self) -> dict[str, str]:
        """Side by side: the port of every server this machine starts at launch (machine 0: its routers too),
        picked now and published in the store at once (`share`), so that machine 0 can publish the trainers' wiring
        before any server answers; role -> address of the roles whose server the trainers talk to runs here."""
        launch = [i for phase in at_launch(self.plan) for i in phase if i in self.servers.mine]
        self.reserved = self.servers.fix_ports(launch)
        self.servers.addresses = addresses(self.plan, {i: a for i, a in self.reserved.items()
                                                       if i in facing(self.plan)})
        return self.servers.addresses

    def start(self) -> dict[str, str]:
        """The launcher's start thread, beside the ranks: this machine's replicas, each published in the store
        once it answered (the other machines' health checks of it begin then); machine 0 then starts its routers
        once every other machine's replica answered (`_exchange` reads them) and publishes them the same way.
        LaunchError naming the server that did not start, here or on another machine."""
        servers = self.servers
        began = time.monotonic()
        servers.start()   # this machine's replicas, and a router whose replicas all run here
        self._publish_answered(began)
        if self.machine in self.optional and not servers.stopping:
            offer(self)   # machine 0 takes its replicas in
        if self.machine != 0 or servers.stopping:
            return servers.addresses
        while not self._others_known.wait(0.25):   # `_exchange` has every other machine's replica, or its failure
            if servers.stopping:
                return servers.addresses
        if servers.start_error is not None:
            raise servers.start_error
        if any(i not in servers.started for i in others(self.plan, 0)):
            return servers.addresses   # the store went away first: its end is named, or the job ended
        rest = [i for phase in at_launch(self.plan) for i in phase if i in servers.mine and i not in servers.started]
        try:
            if rest and servers.start_now(rest) is None:
                return servers.addresses   # stopped meanwhile
        except ServerError as e:
            raise LaunchError(str(e)) from None
        self._publish_answered(began)
        return servers.addresses

    def _publish_answered(self, began: float) -> None:
        """This machine's servers that answered, under their `SERVER_KEY`: the machines watching them begin their
        health checks. A store gone meanwhile ends nothing here: the job ended, or its end is named elsewhere."""
        fresh = {i: a for i, a in self.own().items() if i not in self._answered}
        if not fresh:
            return
        try:
            store = self._connect()
            for index, address in fresh.items():
                store.set(job_store.server_key(index), address)
                self._answered.add(index)
                if self.machine != 0:
                    print(f"dualrun: {self.plan.servers[index].label}: server healthy at {address} (machine "
                          f"{self.machine}); started in {time.monotonic() - began:.1f} s", file=sys.stderr, flush=True)
        except Exception as e:  # noqa: BLE001 - the store is gone: name it while the job runs
            self._store_lost(e)

    def _connect(self) -> Any:
        """A client of the store to set keys in, waited for (machine 0's exists once its agent runs) up to
        `_wait_s`, or until this machine's ranks ended or its servers stop (the store may be gone for good)."""
        deadline = time.monotonic() + _wait_s(self.servers)
        while True:
            try:
                return job_store.connect(self.host, self.port, 2.0)
            except Exception:  # noqa: BLE001 - not up yet, or gone
                if self._ranks_ended or self.servers.stopping or time.monotonic() >= deadline:
                    raise

    def _store_lost(self, e: Exception) -> None:
        """The store went away or a key never came: a death naming it, unless this machine's ranks ended (then
        the job ended: machine 0's store closes with its agent)."""
        if not self._ranks_ended:
            self.servers.report(ServerDeath.of(None, ServerError(
                "the servers' wiring", f"could not be shared through torchrun's store at {self.host}:{self.port}: "
                f"{type(e).__name__}: {e}")))

    @property
    def start_error(self) -> Exception | None:
        return self.servers.start_error

    def started_all(self) -> None:
        self.servers.started_all()

    def wait_stopped(self, timeout: float | None = None) -> bool:
        return self.servers.wait_stopped(timeout)

    def not_started(self, error: "Exception | str") -> None:
        """This machine's servers did not start (`error`): put its first line where the other machines wait for
        them (each server's keys not yet set), so that they end the job too, naming it, instead of waiting for
        servers that never answer; and end this machine's job with it (an `Exception`: the set's start error).
        Best effort: machine 0's store may not be up yet (waited for a minute)."""
        if isinstance(error, Exception):
            self.servers.not_started(error)
        if self._marked:
            return
        self._marked = True
        line = next((ln for ln in str(error).splitlines() if ln.strip()), "no message")
        try:
            store = job_store.connect(self.host, self.port, 60.0)
            for index in self.servers.mine:
                if index not in self.reserved:
                    store.set(job_store.reserved_key(index), job_store.FAILED + line)
                if index not in self._answered:
                    store.set(job_store.server_key(index), job_store.FAILED + line)
        except Exception:  # noqa: BLE001 - no store: machine 0 is not running; this machine's error is named anyway
            pass

    def wiring_env(self) -> dict[str, str]:
        """Only that the ranks read their wiring from the store, where machine 0's launcher puts it once every
        server's address is known (`_exchange`), before any answers."""
        return {protocol.WIRING_FETCH: f"{self.host}:{self.port}"}

    def used(self) -> frozenset[str]:
        return self.servers.used()

    def watch(self) -> None:
        self.servers.watch()

    def unwatch(self) -> None:
        self._ranks_ended = True
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
        return {i: a for i, a in list(self.servers.started.items()) if i in self.servers.mine}

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
        if self.fleet is not None:
            self.fleet.start()
        return thread

    def _exchange(self) -> None:
        servers, plan = self.servers, self.servers.plan
        try:
            store = job_store.connect(self.host, self.port, _wait_s(servers))
            if self.machine == 0:
                store.set(job_store.TOKEN_KEY, self.token)   # the others' servers wait for it (`take_token`)
                store.set(job_store.ATTEMPT_KEY, str(self.attempt))   # this store serves that attempt (`await_attempt`)
            for index, address in self.reserved.items():   # at once: the trainers' wiring needs no answer
                store.set(job_store.reserved_key(index), address)
                if self.machine != 0:
                    print(f"dualrun: {plan.servers[index].label}: server starting at {address} (machine "
                          f"{self.machine}), handed to machine 0", file=sys.stderr, flush=True)
            if self.machine == 0:   # the trainers' wiring, every server still starting: the ranks wait at first use
                at = {i: self.reserved[i] for i in facing(plan) if i in self.reserved}
                at.update({i: self._address(i, store.get(job_store.reserved_key(i)).decode())
                           for i in facing(plan) if plan.servers[i].node != 0})
                wired = addresses(plan, at)
                store.set(job_store.WIRING_KEY, json.dumps({**servers.wiring(wired), **servers.starting_env(wired)}))
            # the servers elsewhere watched from here (`check`), once each answered: machine 0 every other machine's
            # (its routers start in front of them: `start`), machine K those the ranks talk to
            watch = others(plan, 0) if self.machine == 0 else [i for i in facing(plan)
                                                               if plan.servers[i].node != self.machine]
            for index in watch:
                address = self._address(index, store.get(job_store.server_key(index)).decode())
                self.watched[index] = address
                if self.machine == 0 or plan.servers[index].kind == ROUTER:
                    # machine 0: its routers' replicas; machine K: a replica restarted here goes to its router there
                    servers.started[index] = address
        except LaunchError as e:   # another machine's server did not start: never restarted, as here; the
            self.not_started(e)   # machines watching this one's servers learn it too
        except Exception as e:  # noqa: BLE001 - the store went away or a key never came: name it, end the job
            self._store_lost(e)
        finally:
            self._others_known.set()

    def _address(self, index: int, value: str) -> str:
        if value.startswith(job_store.FAILED):
            proc = self.servers.plan.servers[index]
            raise LaunchError(f"{proc.label} did not start on machine {proc.node}: {value[len(job_store.FAILED):]}")
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
            urls = {index: f"http://{address}{liveness_path(self.plan, index)}"   # (one that left: no more)
                    for index, address in list(self.watched.items()) if not self.servers.supervisor.parked(index)}
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
