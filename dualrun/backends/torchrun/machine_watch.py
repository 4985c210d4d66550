"""Several torchrun machines: each launcher's sign of life in machine 0's store, and the watch that ends the job
when a machine goes silent.

Why: a machine that is lost (every process of it killed) or whose link is cut leaves the other machines' ranks
waiting in a collective, up to gloo's and HF's 30 minutes unless `collective_timeout_s` is set, and their error,
when it comes, does not say which machine went away. Here, beside each machine's torchrun agent:
- machine K >= 1 puts its address in the store (the address on its route to machine 0) and adds one to its beat
  counter every second. A store that does not answer for `torchrun.machine_timeout_s` ends its part of the job,
  naming machine 0;
- machine 0 reads every other machine's counter every second: one that has beaten once and then stays still for
  `machine_timeout_s` ends the job, naming the machine and its address. Once ranks failed by themselves,
  `settle` gives each other machine a few seconds to beat again: one that does not is named as the cause.
A machine whose agent returned says so (`LEFT_KEY`) before its beats stop, so its normal end is no loss.
An optional serving machine (plan/optional.py) is not watched here: it may never come, and its loss is its
replicas' (machine_fleet.py). Machines are started by hand, so one may never come: machine 0 names each machine that has not shown itself in the
store (`MACHINE_KEY`) within `torchrun.rendezvous_timeout_s` (`join_timeout_s`), the bound torchrun's rendezvous
waits too; machine K whose agent gave up on machine 0's store names machine 0 (`absent_line`).
The store is torchrun's agent store (job_store.py); machine 0's reads go to its own process, so they never wait on
the network.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Collection

from dualrun.contract import job_store

BEAT_S = 1.0       # how often a machine beats and machine 0 looks
SETTLE_S = 5.0     # after the ranks failed: how long another machine has to beat again before it is named


class MachineWatch:
    """This machine's side (see the module's docstring). `on_lost(line)` is called once, from the watch's thread,
    when a machine is taken for lost; `failure` keeps the line."""

    def __init__(self, host: str, port: int, machine: int, machines: int, timeout_s: float,
                 on_lost: Callable[[str], None], join_timeout_s: float | None = None,
                 workers_started: Callable[[], bool] = lambda: False, optional: Collection[int] = ()) -> None:
        self.host, self.port, self.machine, self.machines = host, port, machine, machines
        self.optional = frozenset(optional)   # machine 0: machines that come and go (machine_fleet.py): not watched
        self.timeout_s, self.on_lost, self.join_timeout_s = timeout_s, on_lost, join_timeout_s
        self.workers_started = workers_started   # machine 0: its agent's rendezvous is over, every machine came
        self.joined: set[int] = set()   # machine 0: the machines seen in the store so far
        self.reached = False            # this machine's client reached machine 0's store
        self._started = time.monotonic()
        self.failure: str | None = None
        self.addresses: dict[int, str] = {0: host}
        self._beats: dict[int, tuple[int, float]] = {}   # machine -> (its counter, when it last changed)
        self._stop = threading.Event()
        self._lock = threading.Lock()    # the watch's thread and `settle` share one store client
        self._store = None
        self._last_ok = 0.0

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, name="dualrun-machine-watch", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._stop.set()

    def leave(self) -> None:
        """This machine's agent returned: say so (best effort: the store may be gone), then stop beating."""
        if self._stop.is_set() and self.machine != 0:
            return   # said already
        self._stop.set()
        if self.machine != 0 and self._store is not None and job_store.listening(self.host, self.port):
            try:
                job_store.connect(self.host, self.port, 2.0).set(job_store.left_key(self.machine), "1")
            except Exception:  # noqa: BLE001 - no store left: machine 0's agent has ended, nobody watches
                pass

    # -- the thread ------------------------------------------------------------------------------------------
    def _run(self) -> None:
        from datetime import timedelta

        if self.machine != 0 and not self._await_store():
            return
        try:   # the store exists once the rendezvous begins (machines are started by hand)
            store = job_store.connect(self.host, self.port)
            self.reached = True
            self._store = store
            self._store.set_timeout(timedelta(seconds=self.timeout_s))
        except Exception:  # noqa: BLE001 - no store: the rendezvous fails and torchrun names it
            return
        if self.machine == 0:
            self._watch_others()
        else:
            self._beat()

    def _await_store(self) -> bool:
        """Machine K: wait for machine 0's store to listen, up to `join_timeout_s` from the start (a TCPStore client
        retries past its own timeout); False when it did not (machine 0 named) or the watch was stopped."""
        deadline = None if self.join_timeout_s is None else self._started + self.join_timeout_s
        while not job_store.listening(self.host, self.port):
            if deadline is not None and time.monotonic() >= deadline:
                self._lost(self.absent_line(self.join_timeout_s))
                return False
            if self._stop.wait(BEAT_S / 4):
                return False
        return True

    def _beat(self) -> None:
        """Machine K: beats on a thread of their own (a store call on a cut link may block past its timeout);
        this one judges the time since the last that was answered."""
        from dualrun.light.ports import route_address

        self._last_ok = time.monotonic()
        threading.Thread(target=self._beat_loop, args=(route_address(self.host),), name="dualrun-machine-beat",
                         daemon=True).start()
        while not self._stop.wait(BEAT_S):
            if time.monotonic() - self._last_ok >= self.timeout_s:
                self._lost(f"machine 0 ({self.host}) did not answer for {self.timeout_s:g} s "
                           f"(torchrun.machine_timeout_s; its store at {self.host}:{self.port}): it was lost or "
                           "ended, or this machine's link to it is cut; ending this machine's part of the job")
                return

    def _beat_loop(self, address: str) -> None:
        assert self._store is not None
        try:
            self._store.set(job_store.machine_key(self.machine), address)
        except Exception:  # noqa: BLE001 - judged by the beats below
            pass
        while not self._stop.wait(BEAT_S):
            try:
                self._store.add(job_store.beat_key(self.machine), 1)
                self._last_ok = time.monotonic()
            except Exception:  # noqa: BLE001 - no answer within the timeout, or the store is gone: judged above
                pass

    def _watch_others(self) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                silent = self.look()
            except Exception:  # noqa: BLE001 - the store is gone: this machine's agent has ended
                return
            missing = self.unjoined() if self.join_timeout_s is not None else []
            if missing and self.workers_started():   # they came: one may run no watch (a launch off the main thread)
                self.joined.update(missing)
            elif missing and time.monotonic() - self._started >= self.join_timeout_s:
                self._lost(self.unjoined_line(missing))
                return
            for k, since in silent.items():
                if since >= self.timeout_s:
                    self._lost(f"{self.name(k)} sent no sign of life for {self.timeout_s:g} s "
                               "(torchrun.machine_timeout_s): it was lost or its link is cut; ending the job")
                    return

    def look(self) -> dict[int, float]:
        """Machine 0: one read of every other machine's counter; machine -> seconds since it last changed, for
        each machine that has beaten once and not left."""
        assert self._store is not None
        with self._lock:
            return self._look()

    def _look(self) -> dict[int, float]:
        now, silent = time.monotonic(), {}
        for k in self.awaited():
            if k not in self.joined and any(self._store.check([key]) for key in (job_store.machine_key(k),
                                                                                  job_store.left_key(k))):
                self.joined.add(k)
            if self._store.check([job_store.left_key(k)]):
                self._beats.pop(k, None)
                continue
            count = self._store.add(job_store.beat_key(k), 0)
            if count == 0:
                continue
            if k not in self.addresses and self._store.check([job_store.machine_key(k)]):
                self.addresses[k] = self._store.get(job_store.machine_key(k)).decode()
            seen, when = self._beats.get(k, (-1, now))
            if count != seen:
                self._beats[k] = (count, now)
                when = now
            silent[k] = now - when
        return silent

    def settle(self) -> str | None:
        """Machine 0, once its ranks failed: the first other machine that neither beats again nor leaves within
        SETTLE_S, named as the likely cause; None when every one answers (or this is not machine 0)."""
        if self.machine != 0 or self._store is None or self.failure is not None:
            return self.failure
        self._stop.set()
        deadline, start = time.monotonic() + SETTLE_S, time.monotonic()
        try:
            self.look()   # the counters as they are now: a beat written since the watch's last look is no sign of life
            before = {k: c for k, (c, _) in self._beats.items()}
            while time.monotonic() < deadline:
                self.look()
                still = [k for k in before if k in self._beats and self._beats[k][0] == before[k]]
                if not still:
                    return None
                time.sleep(max(0.0, min(BEAT_S / 2, deadline - time.monotonic())))   # not past SETTLE_S
        except Exception:  # noqa: BLE001 - the store is gone: nothing more to learn
            return None
        k = still[0]
        waited = time.monotonic() - start
        return (f"{self.name(k)} sent no sign of life for {waited:.0f} s after this machine's ranks failed: it was "
                "lost or its link is cut")

    def unjoined(self) -> list[int]:
        """Machine 0: the other machines not seen in the store (as of the last look)."""
        return [k for k in self.awaited() if k not in self.joined] if self.machine == 0 else []

    def awaited(self) -> list[int]:
        """The other machines the job needs (an optional one's replicas are health-checked instead)."""
        return [k for k in range(1, self.machines) if k not in self.optional]

    def unjoined_line(self, missing: list[int]) -> str:
        """Machine 0: the line naming the machines that did not come within the rendezvous bound."""
        names = ", ".join(str(k) for k in missing)
        who = f"machine {names}" if len(missing) == 1 else f"machines {names}"
        bound = f"{self.join_timeout_s:g} s " if self.join_timeout_s is not None else ""
        return (f"{who} did not join within {bound}(torchrun.rendezvous_timeout_s): not started, or unable to reach "
                f"machine 0's store at {self.host}:{self.port} (main_process_ip, main_process_port); ending the job")

    def absent_line(self, waited_s: float) -> str:
        """Machine K whose rendezvous gave up: the line naming machine 0, which never answered."""
        return (f"machine 0 ({self.host}) did not answer within {waited_s:g} s (torchrun.rendezvous_timeout_s; its "
                f"store at {self.host}:{self.port}, main_process_ip and main_process_port): it is not started, has "
                "ended, or this machine cannot reach it; ending this machine's part of the job")

    def name(self, k: int) -> str:
        address = self.addresses.get(k)
        return f"machine {k} ({address})" if address else f"machine {k}"

    def _lost(self, line: str) -> None:
        if self.failure is None and not self._stop.is_set():
            self.failure = line
            self.on_lost(line)

