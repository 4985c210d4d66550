"""Several torchrun machines where some run no trainer ranks (the trainers' `roles.<name>.machines`): the serving
machine's attempt, and machine 0's word to it on how the job ended.

Why: a machine that only serves has no torchrun agent, so nothing there ends when the ranks end, and the one
channel to machine 0, the agent store at main_process_ip:main_process_port, closes with machine 0's agent. So:
- the serving machine (`serve`) starts its servers (Launcher.launch), shares their addresses through the store
  (`Machines.share`), beats and watches machine 0 (`MachineWatch`), health-checks the servers of machine 0 its
  ranks talk to, and waits for the job's result;
- machine 0's launcher holds its agent's store past the agent (light/held_stores.py), writes the result there
  (`announce`: the exit code, the line naming the failure, whether the job restarts) and waits, bounded, for each
  serving machine to say it read it (its `LEFT_KEY`) before the store closes.
An optional serving machine (plan/optional.py) stopped by SIGTERM or SIGINT while the job runs leaves it instead:
machine 0 drains its replicas first (machine_fleet.py), then it stops them and ends with exit 0.
The serving machine ends with exit 0 when the ranks succeeded; non-zero naming machine 0 when they failed, when
machine 0 went silent (`torchrun.machine_timeout_s`) or its store closed without a result; non-zero naming its own
server when one died (machine 0 health-checks it and ends the ranks too).
"""
from __future__ import annotations

import json
import signal
import sys
import threading
import time
from typing import Any, Callable, Sequence

from dualrun.contract import job_store
from dualrun.launchers.launcher import JobResult, Outcome, stopped_by
from dualrun.backends.torchrun.machine_fleet import leave
from dualrun.backends.torchrun.machine_watch import MachineWatch
from dualrun.backends.torchrun.machine_servers import Machines

LOOK_S = 0.5         # how often the serving machine looks for the result
ANNOUNCE_S = 30.0    # how long machine 0 keeps its store for the serving machines to read the result


def machines_with_ranks(plan: Any) -> list[int]:
    """The machines of the plan that run trainer ranks, in order (torchrun's nodes)."""
    return sorted({p.node for p in plan.workers})


def serving_machines(plan: Any, num_machines: int) -> list[int]:
    """The machines of the plan that run no trainer rank."""
    with_ranks = machines_with_ranks(plan)
    return [k for k in range(num_machines) if k not in with_ranks]


def serve(servers: Machines, host: str, port: int, machine: int, machines: int, timeout_s: float,
          restartable: bool) -> Outcome:
    """The serving machine's attempt, its servers already started: to the job's end (see the module's docstring)."""
    start = time.monotonic()
    lost: list[str] = []
    stop = threading.Event()
    signals: list[int] = []
    servers.watch()
    watch = MachineWatch(host, port, machine, machines, timeout_s, lambda line: (lost.append(line), stop.set()))
    watch.start()
    servers.share()
    restore = _on_signals(lambda signum: (signals.append(signum), stop.set()))
    try:
        result = _wait_result(servers, host, port, stop)
    finally:
        restore()
        servers.unwatch()
    took = time.monotonic() - start
    if signals and machine in servers.optional and result is None and servers.failure is None:
        print(leave(host, port, machine, signal.Signals(signals[0]).name), file=sys.stderr, flush=True)
        watch.leave()   # an optional machine leaves the job that goes on: its part ended well
        return Outcome(JobResult(0, wall_time_s=time.monotonic() - start))
    if signals:
        watch.leave()
        return Outcome(stopped_by(signals[0], "this machine's servers were stopped", took))
    if servers.failure is not None:
        watch.leave()
        failure = servers.failure
        return Outcome(JobResult(1, wall_time_s=took, message=str(failure)),
                       f"{failure.one_line()}; restarting the job with fresh servers" if restartable else None,
                       (failure,))
    if lost:
        watch.stop()
        return Outcome(JobResult(1, wall_time_s=took, message=lost[0]))
    if result is None:
        watch.stop()
        return Outcome(JobResult(1, wall_time_s=took, message=(
            f"machine 0 ({host}) ended without a result: its store at {host}:{port} closed before its launcher "
            "said how the job ended (its launcher was killed or lost)")))
    if result.get("exit_code") == 0:
        servers.finish()   # before the servers stop: their end is no death for anyone still looking
    watch.leave()          # machine 0 waits for this before its store closes
    code = int(result.get("exit_code", 1))
    if code == 0:
        return Outcome(JobResult(0, wall_time_s=took))
    message = f"machine 0 ({host}): {result.get('message') or f'the job failed (exit code {code})'}"
    return Outcome(JobResult(code, wall_time_s=took, message=message),
                   message + "; restarting the job" if result.get("restart") else None)


def _wait_result(servers: Machines, host: str, port: int, stop: threading.Event) -> dict[str, Any] | None:
    """Machine 0's result once it is in the store; None when the store closed without one, or `stop` was set, or
    one of this machine's servers (or one of machine 0's that its ranks talk to) died. The store is read on a
    thread of its own: a read over a cut link may block past its timeout, and `stop` (the watch's loss, a signal)
    must end the wait all the same."""
    found: list[dict[str, Any] | None] = []
    done = threading.Event()
    threading.Thread(target=_look_result, args=(servers, host, port, stop, found, done), name="dualrun-result",
                     daemon=True).start()
    while not stop.wait(LOOK_S) and servers.failure is None and not done.is_set():
        pass
    return found[0] if found and not stop.is_set() else None


def _look_result(servers: Machines, host: str, port: int, stop: threading.Event,
                 found: list[dict[str, Any] | None], done: threading.Event) -> None:
    store, seen = None, False
    while not stop.wait(LOOK_S) and servers.failure is None:
        try:
            if store is None:
                if not job_store.listening(host, port):
                    if seen:
                        break
                    continue   # machine 0 has not started yet: it is started by hand
                store = job_store.connect(host, port, 10.0)
                seen = True
            if store.check([job_store.RESULT_KEY]):
                found.append(json.loads(store.get(job_store.RESULT_KEY)))
                break
        except Exception:  # noqa: BLE001 - the store went away meanwhile: the next look finds it gone
            store = None
    done.set()


def _on_signals(handle: Callable[[int], None]) -> Callable[[], None]:
    """SIGTERM and SIGINT end the serving machine's wait (main thread only); returns what restores the handlers."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    for s in before:
        signal.signal(s, lambda signum, _frame: handle(signum))

    def restore() -> None:
        for s, h in before.items():
            signal.signal(s, h)

    return restore


def announce(held: list[Any], outcome: Outcome, restarts: bool, serving: Sequence[int],
             wait_s: float = ANNOUNCE_S) -> None:
    """Machine 0, its agent returned: the job's result in its store (still held open: `held`) for the `serving`
    machines, then wait (at most `wait_s`) until each has said it left, then let the store close."""
    if not held:
        return
    result = outcome.result
    value = json.dumps({"exit_code": result.exit_code, "message": result.message or "",
                        "restart": bool(outcome.restart) and restarts})
    try:
        store = held[0]   # the agent's own store, as a client of itself: no network
        store.set(job_store.RESULT_KEY, value)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not all(store.check([job_store.left_key(k)]) for k in serving):
            time.sleep(0.2)
    except Exception:  # noqa: BLE001 - no store: the serving machines find it closed and say so
        pass
    finally:
        held.clear()
