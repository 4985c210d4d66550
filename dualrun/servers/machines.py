"""Multi-machine torchrun: a separate role's servers on several machines, wired through torchrun's agent store.

Why: machines started by hand do not talk before the job, and a role's replicas may run on any of them (the plan
fills machine 0's free GPUs first, then machine 1's, ...). Each machine's launcher starts and watches its own
servers before its torchrun agent; then, beside the agent, `share` runs in a thread:
- machine K >= 1 publishes the address of each server it runs (`job_store.SERVER_KEY`);
- machine 0 reads the others' addresses, starts the routers in front of every replica (watched and stopped
  with its other servers), and publishes the trainers' wiring env (`job_store.WIRING_KEY`), the same for
  every machine. Every rank reads it before the user's program starts (dualrun/rank/store_wiring.py), so no
  rank uses the router's address before it answers for every replica.
Machine 0 also health-checks the other machines' servers while the job runs (LocalServers.check), so a replica
that dies on machine K ends the job there (its launcher watches the process) and on machine 0 within seconds;
machine K health-checks machine 0's routers the same way (machine 0 publishes their addresses too), so machine 0
or its router dying ends machine K's job instead of leaving its ranks waiting in a collective. Each machine says
when its ranks finished (`finish`) so that its servers' normal end is no failure. The store is the
one at `main_process_ip:main_process_port` (static rendezvous: the agent store; c10d: the rendezvous store).
Every machine hosts trainer ranks (torchrun needs `num_processes` to be a multiple of `num_machines`), so a
machine that only serves does not arise.
"""
from __future__ import annotations

import json
import sys
import threading
from typing import Callable

from dualrun import job_store
from dualrun.servers.local import LocalServers
from dualrun.servers.process import ServerError


def share(servers: LocalServers, host: str, port: int, on_failure: Callable[[ServerError], None],
          attempt: int = 0) -> threading.Thread:
    """Run the exchange above in a daemon thread (the store exists once torchrun's agent rendezvous begins).
    A router that fails, or an address that never comes, is recorded as `servers.failure` and `on_failure` is
    called (the launcher ends the job with it); nothing is reported once the servers are being stopped."""

    def run() -> None:
        here = servers.cfg.machine_rank
        servers.finished_elsewhere = lambda machine: _finished(host, port, machine, gone_is_finished=here == 0)
        try:
            store = job_store.connect(host, port, _wait_s(servers))
            if here == 0:
                store.set(job_store.ATTEMPT_KEY, str(attempt))   # this store serves that attempt (`await_attempt`)
            for index, address in servers.own().items():
                store.set(job_store.server_key(index), address)
                if here != 0:
                    print(f"dualrun: {servers.plan.servers[index].label}: server healthy at {address} (machine "
                          f"{here}), handed to machine 0", file=sys.stderr, flush=True)
            if here != 0:   # watch the servers the ranks talk to that run elsewhere (LocalServers.check)
                servers.started.update({i: _address(servers, i, store.get(job_store.server_key(i)).decode())
                                        for i in servers.facing() if servers.plan.servers[i].node != here})
                return
            remote = {i: _address(servers, i, store.get(job_store.server_key(i)).decode()) for i in servers.others()}
            addresses = servers.complete(remote)
            if not addresses and servers.plan.servers:
                return   # stopped meanwhile
            for index in servers.pending_done:
                proc = servers.plan.servers[index]
                store.set(job_store.server_key(index), servers.started[index])   # the other machines watch it
                print(f"dualrun: {proc.unit}: server healthy at {servers.started[index]}", file=sys.stderr,
                      flush=True)
            store.set(job_store.WIRING_KEY, json.dumps(servers.shared_wiring()))
            # the thread that started the routers stays until they stop: a server dies with the thread that
            # spawned it (PR_SET_PDEATHSIG, dualrun.parent_death)
            servers.stopped.wait()
        except ServerError as e:
            _fail(servers, e, on_failure)
        except Exception as e:  # noqa: BLE001 - the store went away or a key never came: name it, end the job
            _fail(servers, ServerError("the servers' wiring", f"could not be shared through torchrun's store at "
                                       f"{host}:{port}: {type(e).__name__}: {e}"), on_failure)

    thread = threading.Thread(target=run, name="dualrun-server-wiring", daemon=True)
    thread.start()
    return thread


def _address(servers: LocalServers, index: int, value: str) -> str:
    if value.startswith(job_store.FAILED):
        proc = servers.plan.servers[index]
        raise ServerError(proc.label, f"did not start on machine {proc.node}: {value[len(job_store.FAILED):]}")
    return value


def not_started(servers: LocalServers, host: str, port: int, error: str) -> None:
    """Machine K >= 1 whose servers did not start: put the reason where machine 0 waits for their addresses, so
    it ends the job too (naming them) instead of waiting for addresses that never come. Best effort: machine 0's
    store may not be up yet (waited for a minute)."""
    if servers.cfg.num_machines == 1 or servers.cfg.machine_rank == 0:
        return
    mine = [i for i, p in enumerate(servers.plan.servers) if p.node == servers.cfg.machine_rank]
    if not mine:
        return
    line = next((ln for ln in error.splitlines() if ln.strip()), "no message")
    try:
        store = job_store.connect(host, port, 60.0)
        for index in mine:
            store.set(job_store.server_key(index), job_store.FAILED + line)
    except Exception:  # noqa: BLE001 - no store: machine 0 is not running; this machine's error is named anyway
        pass


def await_attempt(host: str, port: int, attempt: int, timeout_s: float = job_store.WAIT_S) -> None:
    """Machine K >= 1, before its restart `attempt`: wait while the store at `host:port` is still the ending
    attempt's (machine 0 restarts too, on the same port, once its agent has stopped), so that neither this machine's
    addresses nor its torchrun agent go to a store about to vanish. Returns once it is gone or marked `attempt`."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _listening(host, port):
        try:
            store = job_store.connect(host, port, 2.0)
            if store.check([job_store.ATTEMPT_KEY]) and int(store.get(job_store.ATTEMPT_KEY)) >= attempt:
                return
        except Exception:  # noqa: BLE001 - the store went away meanwhile: the next look sees it gone
            pass
        time.sleep(0.5)


def finish(servers: LocalServers, host: str, port: int) -> None:
    """A machine whose ranks are done: say so before its servers stop, so that the machines watching them do not
    take their end for a death. The store may be gone already (it ends with machine 0's torchrun agent): then every
    machine's ranks passed torchrun's exit barrier, and each machine's watch ends as its own agent returns."""
    if servers.cfg.num_machines == 1 or not servers.own():
        return
    if not _listening(host, port):
        return
    try:
        job_store.connect(host, port, 5.0).set(job_store.finished_key(servers.cfg.machine_rank), "1")
    except Exception:  # noqa: BLE001 - no store left: nobody watches this machine's servers any more
        pass


def _listening(host: str, port: int) -> bool:
    """Whether the store still listens (a plain connect: a TCPStore client retries for its whole timeout)."""
    import socket

    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _finished(host: str, port: int, machine: int, gone_is_finished: bool) -> bool:
    """Whether `machine` said its ranks finished. A store that is gone means this machine's own agent ended on
    machine 0 (`gone_is_finished`), but machine 0's end on machine K: silence there is a failure."""
    if not _listening(host, port):
        return gone_is_finished
    try:
        return job_store.connect(host, port, 2.0).check([job_store.finished_key(machine)])
    except Exception:  # noqa: BLE001 - the store went away meanwhile: as above
        return gone_is_finished


def _wait_s(servers: LocalServers) -> float:
    """How long a key may take: another machine starts by hand, then waits for its own servers' health."""
    timeouts = [servers.cfg.role(p.roles[0]).health_timeout_s for p in servers.plan.servers]  # type: ignore[union-attr]
    return job_store.WAIT_S + max(timeouts, default=0.0)


def _fail(servers: LocalServers, error: ServerError, on_failure: Callable[[ServerError], None]) -> None:
    if servers.stopping:
        return
    if servers.failure is None:
        servers.failure = error
    on_failure(servers.failure)
