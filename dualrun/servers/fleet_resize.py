"""A fleet's resize: a role's replicas grown onto its spares or shrunk (`dualrun scale`, Ray's room that comes and
goes), another machine's replicas taken in and let go with it, and the job summary's join lines.

Why apart from supervisor.py: a resize is its own story (one at a time, replicas started side by side, drained
before they stop), told over the supervisor's state (its lock, its table, the plan) and a few of its steps; the
supervisor's own part is a death, a restart and a hung replica. A mixin, so that `Supervisor` keeps one lock and
one table, and its callers (the server sets, the job's control channel, the machine fleet) one object.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Callable, NamedTuple

from dualrun.contract.errors import ScaleCutShort, ScaleRefused
from dualrun.servers.supervision import HUNG_GRACE_S, joined_line, joined_summary, router_of

FIRST_REQUEST_EVERY_S = 1.0   # a joined teacher: how often its router is asked for the step of its first request
DRAIN_S = 30.0       # a replica resized away: how long the requests in flight on it may take to end


class Joined(NamedTuple):
    """A replica taken in by its router (supervisor.py's `_bring_in`)."""

    address: str
    started_s: float     # its engine's start-up, while the others served
    step: int | None     # the trainer's step it serves from (its router's `from_step`); None: not known yet
    last: int | None     # the trainer's latest step its router heard of


class FleetResize:
    """The fleet's half of `Supervisor` (supervisor.py), which inherits it and holds what it relies on:
    `plan`, `table` (supervision.py's `Supervision`), `events`, `replicas`, `address_of`, `_lock` (around each
    use of `table`, `history` and `_unknown_step`), `_resizing`, `_joining`, `history`, `_unknown_step`; and the
    supervisor's steps `_bring_in` (a replica started and taken in by its router), `_retire` and `_gone`."""

    def _running(self, unit: str) -> int:
        with self._lock:
            return len(self.table.running(unit))

    def fleets(self) -> dict[str, dict[str, int]]:
        """Each role `dualrun scale` resizes: its replicas running (or starting) now and its bounds
        (launchers/job_control.py). Not a fleet that moves by machines (plan/optional.py)."""
        from dualrun.plan.optional import machine_of_fleet

        by_machines = machine_of_fleet(self.plan)
        return {unit: {"replicas": self._running(unit), "min": b.low, "max": b.high}
                for unit, b in self.plan.fleets.items() if b.resizable and unit not in by_machines}

    # -- another machine's replicas that come and go with it (backends/torchrun/machine_fleet.py) ---------------
    def take_in(self, index: int, address: str) -> Joined | None:
        """Parked replica `index`, started by its own machine at `address`: taken in by its router as a grown spare
        is (held for the trainer's weights where it takes them); None when it is not parked or the set stops. Any
        failure parks it again and is raised."""
        with self._lock:
            if index not in self.table.parked:
                return None
            self.table.parked.discard(index)
            self.table.down.add(index)
        self._joining.add(index)
        try:
            return self._bring_in(index, self.plan.servers[index].label, 0, again=False, elsewhere=address)
        except Exception:
            self._park(index)
            raise
        finally:
            self._joining.discard(index)

    def depart(self, indices: list[int], why: str) -> int:
        """Running replicas `indices` of one role leave with their machine: parked at once (their end is no
        death), retired at the router, drained (`_shrink`); how many of the role run now."""
        unit = self.plan.servers[indices[0]].unit
        with self._lock:
            self.table.parked.update(indices)
            self.table.down.difference_update(indices)
        self._shrink(unit, indices, why)
        return self._running(unit)

    def parked(self, index: int) -> bool:
        """Whether replica `index` runs nowhere the job knows of (a spare, gone, or its machine not come)."""
        with self._lock:
            return index in self.table.parked

    def scale(self, unit: str, replicas: int) -> str:
        """Resize `unit` to `replicas` within its bounds: spares started side by side and taken in by the router
        (held for the trainer's weights where they take them), or the highest replicas retired (drained, then
        stopped); the line of what was done. ScaleRefused when it cannot; one resize at a time."""
        from dualrun.plan.optional import machine_of_fleet

        fleet = self.plan.fleets.get(unit)
        if unit in machine_of_fleet(self.plan):
            raise ScaleRefused(f"{unit}: on several torchrun machines its fleet follows its optional machines: "
                               "launch one (`dualrun launch ... --machine_rank K`) to grow it, stop one (SIGTERM) to "
                               "shrink it")
        if fleet is None or not fleet.resizable:
            names = ", ".join(u for u, b in self.plan.fleets.items() if b.resizable) or "none"
            raise ScaleRefused(f"no resizable fleet {unit!r} in this job (resizable: {names}; set "
                               f"roles.<name>.max_replicas above min_replicas)")
        if not fleet.low <= replicas <= fleet.high:
            raise ScaleRefused(f"{unit}: {replicas} replicas is out of its bounds (min_replicas {fleet.low}, "
                               f"max_replicas {fleet.high})")
        if not self._resizing.acquire(blocking=False):
            raise ScaleRefused(f"{unit}: another resize of this job is under way; ask again once it is done")
        try:
            if not self.events.watching:
                raise ScaleRefused("the job is not running (starting, or ending): nothing was resized")
            with self._lock:
                now = len(self.table.running(unit))
                start = self.table.to_start(unit, replicas - now) if replicas > now else []
                stop = self.table.to_stop(unit, now - replicas) if replicas < now else []
            if not start and not stop:
                return f"dualrun: {unit}: {now} replicas already (min {fleet.low}, max {fleet.high}); nothing to do"
            if stop:
                return self._shrink(unit, stop)
            return self._grow(unit, start)
        finally:
            self._resizing.release()

    def _grow(self, unit: str, indices: list[int]) -> str:
        """Start the parked replicas `indices` at once; each one's line as it serves. ScaleRefused naming the ones
        that did not (they are parked again, their remains stopped: the job goes on); ScaleCutShort when the job
        ended (its servers stopped) before they all joined."""
        began = time.monotonic()
        failed: dict[int, str] = {}
        cut: list[str] = []   # the labels of those the job's end cut short
        done = {i: threading.Event() for i in indices}

        def one(index: int) -> None:
            label = self.plan.servers[index].label
            self._joining.add(index)
            try:
                brought = self._bring_in(index, label, 0, again=False)
                if brought is None:   # the set stopped meanwhile: the job ended, nothing joined
                    cut.append(label)
                else:
                    seconds = time.monotonic() - began
                    print(joined_line(label, brought.address, brought.step, seconds, brought.started_s, brought.last),
                          file=sys.stderr, flush=True)
                    how = f"after the resize asked for it (its engine started in {brought.started_s:.1f} s)"
                    self.summarise_join(index, brought, lambda step: joined_summary(label, step, seconds, how))
            except Exception as e:  # noqa: BLE001 - any failure to join is the resize's, named
                failed[index] = str(e).splitlines()[0] if str(e) else type(e).__name__
            finally:
                self._joining.discard(index)
                done[index].set()
            if index not in failed and label not in cut:
                # a local engine's parent-death signal fires when the thread that spawned it ends: this one stays
                self.events.wait_stopped()

        for index in indices:
            threading.Thread(target=one, args=(index,), name="dualrun-grow", daemon=True).start()
        for event in done.values():
            event.wait()
        if cut or (failed and not self.events.watching):   # (a failure then is the job's end's: its router gone)
            waiting = sorted(cut + [self.plan.servers[i].label for i in failed])
            raise ScaleCutShort(f"{unit}: the job ended during the resize, before {' and '.join(waiting)} joined "
                                "(the launch's output says why)")
        for index in failed:
            self._park(index)
        running = self._running(unit)
        if failed:
            raise ScaleRefused(f"{unit}: " + "; ".join(failed.values()) + f"; {running} replicas run")
        return f"dualrun: {unit}: {running} replicas now ({len(indices)} joined in {time.monotonic() - began:.1f} s)"

    def summarise_join(self, index: int, joined: Joined, entry: Callable[[int | None], str]) -> None:
        """The job's summary says a join (`entry`: its words given the step it serves from). A replica that
        joined before the trainer's next request (a teacher: no weights to wait for) serves from a step its router
        learns later: its entry is completed then (its router asked every `FIRST_REQUEST_EVERY_S` while the job
        runs, from a thread of its own, and once more as it leaves, before the retire clears its row: `_retire`),
        or says the step is unknown."""
        with self._lock:
            at = len(self.history)
            self.history.append(entry(joined.step))
            if joined.step is not None:
                return
            self._unknown_step[index] = (at, joined.address, entry)

        def follow() -> None:
            from dualrun.servers import router_client

            router, slot = router_of(self.plan, index)
            while index in self._unknown_step and not self.events.wait_stopped(FIRST_REQUEST_EVERY_S):
                try:
                    self._settle_step(index, router_client.replicas(self.address_of(router) or "")["replicas"][slot])
                except (OSError, ValueError, KeyError, IndexError):
                    continue   # (a router being restarted; one gone ends the job)

        threading.Thread(target=follow, name="dualrun-first-request", daemon=True).start()

    def _settle_step(self, index: int, row: dict) -> None:
        """Joined replica `index`'s summary entry, once its router's `row` knows the step it served from; given up
        when the row is another engine's (it left, or its slot was refilled)."""
        with self._lock:
            pending = self._unknown_step.get(index)
            if pending is None:
                return
            at, address, entry = pending
            if row.get("address") != address:
                del self._unknown_step[index]
            elif row.get("from_step") is not None:
                self.history[at] = entry(row["from_step"])
                del self._unknown_step[index]

    def _park(self, index: int) -> None:
        """A replica that failed to join: out of its router's slot, its remains stopped, parked again."""
        try:
            self._retire(index, "did not join")
        except (OSError, RuntimeError):
            pass   # its router gone too: the watcher ends the job
        self.replicas.kill(index, HUNG_GRACE_S)
        with self._lock:
            self.table.down.discard(index)
            self.table.parked.add(index)

    def _shrink(self, unit: str, indices: list[int], why: str = "scaled down") -> str:
        """Retire `indices` at their router (no new request goes to them), let the requests in flight on them end
        (up to `DRAIN_S`), stop them (another machine's: its machine does); their lines."""
        from dualrun.servers import router_client

        for index in indices:
            self._retire(index, why)
        at = self.address_of(router_of(self.plan, indices[0])[0])
        assert at is not None
        deadline = time.monotonic() + DRAIN_S
        slots = [router_of(self.plan, i)[1] for i in indices]
        while time.monotonic() < deadline and any(router_client.replicas(at)["replicas"][s]["in_flight"]
                                                  for s in slots):
            time.sleep(0.1)
        for index in indices:
            self._gone(index, HUNG_GRACE_S, why, why)
        return f"dualrun: {unit}: {self._running(unit)} replicas now ({len(indices)} left)"
