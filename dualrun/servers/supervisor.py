"""The one supervisor of a set's engine replicas, on either backend: a death restarted or made the job's, a hung
replica found and stopped, a restarted one taken back by its router (held until it has the trainer's weights), a
lone server (no router in front) probed and, hung, stopped (its death the job's).

Why apart from the server sets: the policy (supervision.py's table) and the steps of a restart (the router's
`remove`, a fresh process, the router's `replace`, the wait for rotation, the lines the user reads) are the same
whether the replica is a process here (`LocalServers`) or runs from a Ray actor (`RayServers`); a backend only
gives the few primitives below (`Replicas`). The multi-machine wrapper (backends/torchrun/machine_servers.py) adds
what only several machines need: the router's view of whether another replica serves.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Callable, Collection, NamedTuple, Protocol

from dualrun.contract.errors import ScaleCutShort, ScaleRefused
from dualrun.plan.processes import Plan
from dualrun.programs.rotation import PROBE_INTERVAL_S, PROBE_TIMEOUT_S
from dualrun.servers.process import ServerError
from dualrun.servers.server_death import ServerDeath
from dualrun.servers.supervision import (HUNG_GRACE_S, Supervision, back_line, held_line, hung_line, joined_line,
                                         joined_summary, left_line, liveness_path, restarting_line, router_of,
                                         stopped_answering)

FIRST_REQUEST_EVERY_S = 1.0   # a joined teacher: how often its router is asked for the step of its first request
HUNG_EVERY_S = 1.0   # how often the routers are asked for hung replicas (they probe about once a second)
DRAIN_S = 30.0       # a replica resized away: how long the requests in flight on it may take to end


class Joined(NamedTuple):
    """A replica taken in by its router (`_bring_in`)."""

    address: str
    started_s: float     # its engine's start-up, while the others served
    step: int | None     # the trainer's step it serves from (its router's `from_step`); None: not known yet
    last: int | None     # the trainer's latest step its router heard of


class Events(Protocol):
    """What the supervisor asks of its server set (serverset.py's `ServerSetBase`): one way, so the set holds its
    supervisor without the two importing each other."""

    @property
    def watching(self) -> bool: ...

    def report(self, death: ServerDeath) -> None: ...

    def fatal(self, death: ServerDeath) -> None: ...

    def wait_stopped(self, timeout: float | None = None) -> bool: ...


class Replicas(Protocol):
    """What a backend does to one of the plan's replicas (by its plan.servers index), for the supervisor."""

    def respawn(self, index: int, restart: int) -> str | None:
        """The dead replica's process again (its `restart`-th), on its devices, on a fresh port, healthy: its
        address (None: the set is being stopped). ServerError when it fails."""

    def alive(self, index: int) -> bool:
        """Whether its process runs (a hung one does)."""

    def kill(self, index: int, grace_s: float) -> tuple[str, str | None]:
        """Stop it (SIGTERM, SIGKILL after `grace_s`) without its end being an event of its own: its log's last
        lines and its log's path."""

    def rearm(self, index: int, address: str) -> bool:
        """It serves at `address` again: its next end is an event. False when the set is being stopped."""


class Supervisor:
    """The replicas of `plan` that a set runs (`mine`), supervised under supervision.py's rules.

    `events`: the set whose watchers report deaths (`report`) and that queues the ones the job does not survive;
    `replicas`: the backend's primitives; `address_of`: a server's address as the set knows it (a router's, for
    the restart's steps). `others_serving` (several machines: its router's view) is asked before a restart."""

    def __init__(self, plan: Plan, events: "Events", replicas: Replicas,
                 address_of: Callable[[int], str | None], mine: Collection[int] | None = None) -> None:
        self.plan, self.events, self.replicas, self.address_of = plan, events, replicas, address_of
        self.table = Supervision.of(plan, mine)
        self.others_serving: Callable[[int], bool] = lambda index: True
        self._lock = threading.Lock()
        self._last_look = 0.0
        self._prober: threading.Thread | None = None   # probes the lone servers while the set is watched
        self._resizing = threading.Lock()   # one resize at a time (`scale`)
        self._joining: set[int] = set()     # replicas a resize is starting (their death is the resize's failure)
        self.history: list[str] = []        # each change of a fleet, for the job's summary ("... joined 6.2 s after ...")
        # joined replicas whose step is not known yet: index -> (its history entry's position, its address, the entry)
        self._unknown_step: dict[int, tuple[int, str, Callable[[int | None], str]]] = {}

    @property
    def restarting(self) -> frozenset[int]:
        """The replicas being restarted now."""
        with self._lock:
            return frozenset(self.table.down)

    def used(self, index: int) -> int:
        with self._lock:
            return self.table.used(index)

    def checked(self, index: int, answered: bool) -> bool:
        """Another machine's server answered its health check or not: True when it is dead (supervision.py)."""
        with self._lock:
            return self.table.checked(index, answered)

    @property
    def missing(self) -> bool:
        """Whether another machine's server missed a check and is not yet judged (a second look decides)."""
        with self._lock:
            return self.table.missing

    # -- a death ---------------------------------------------------------------------------------------------
    def report(self, death: ServerDeath) -> None:
        """A server ended: restarted (in a thread of its own) when the job survives it, else the job's (`fatal`)."""
        index = death.index
        if index in self._joining:   # a resize is starting it: its `_bring_in` fails and parks it again
            return
        ask = index is not None and self.events.watching and (self.table.supervises(index) or
                                                              self.table.in_fleet(index))
        others = ask and self.others_serving(index)   # (outside the lock: several machines ask the router)
        with self._lock:   # a replica whose node is gone is not restarted there: it leaves, or the job ends
            restart = not death.node_gone and self.table.died(index, others)
            line = restart and restarting_line(death.one_line(), self.table.used(index), self.table.allowed[index])
            leaves = not restart and self.table.leaves(index, others)
        if leaves:
            threading.Thread(target=self._leave, args=(death,), name="dualrun-leave", daemon=True).start()
            return
        if not restart:
            self.events.fatal(death)
            return
        print(line, file=sys.stderr, flush=True)
        threading.Thread(target=self._replace, args=(death,), name="dualrun-replace", daemon=True).start()

    def _replace(self, death: ServerDeath) -> None:
        """Restart the dead replica, have its router take it back; any failure on the way ends the job, naming it."""
        index = death.index
        assert index is not None
        label = self.plan.servers[index].label
        try:
            self._restart(index, label, time.monotonic())
        except ServerError as e:
            self.events.fatal(ServerDeath.of(index, e))
        except (OSError, RuntimeError) as e:
            self.events.fatal(ServerDeath.of(index, ServerError(label, f"could not be taken back by its router "
                                                                      f"after a restart ({e})")))
        self.events.wait_stopped()   # a local engine's parent-death signal fires when the thread that spawned it ends

    def _restart(self, index: int, label: str, died: float) -> None:
        """`remove` at the router (out of the weight-sync group: the next sync goes on without it), then
        `_bring_in`; the line that it is back."""
        from dualrun.servers import router_client   # (urllib: off the launch path until a restart)

        router, slot = router_of(self.plan, index)
        at = self.address_of(router)
        assert at is not None
        router_client.control(at, slot, "remove", reason="died; being restarted")
        brought = self._bring_in(index, label, self.used(index), again=True)
        if brought is not None and self.events.watching:   # else the ranks ended: its router takes it back itself
            print(back_line(label, brought.address, time.monotonic() - died, brought.started_s), file=sys.stderr,
                  flush=True)

    def _bring_in(self, index: int, label: str, restart: int, again: bool,
                  elsewhere: str | None = None) -> Joined | None:
        """Start replica `index`'s engine (`respawn`; `elsewhere`: its address, another machine started it), `replace`
        its slot at the router (held until its first weight update when it takes the trainer's weights), wait for
        rotation: what `Joined` holds, None when the set is stopped meanwhile."""
        from dualrun.servers import router_client

        router, slot = router_of(self.plan, index)
        at = self.address_of(router)
        assert at is not None
        serving = self.plan.servers[index].serving
        assert serving is not None
        began = time.monotonic()
        address = self.replicas.respawn(index, restart) if elsewhere is None else elsewhere
        if address is None:
            return None
        started_s = time.monotonic() - began   # the fresh engine's start-up, while the other replicas serve
        router_client.control(at, slot, "replace", address=address, hold=serving.takes_weights)
        if serving.takes_weights:
            print(held_line(label, address, started_s, again), file=sys.stderr, flush=True)
        # held: until the next sync, however far; else within its health timeout
        deadline = None if serving.takes_weights else time.monotonic() + serving.health_timeout_s
        stats: dict = {}
        row: dict = {}
        while self.events.watching:
            stats = router_client.replicas(at)
            row = stats["replicas"][slot]
            if slot in stats["in_rotation"]:
                break
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError(f"its router's health probes did not pass within {serving.health_timeout_s:g} s")
            if elsewhere is None and not self.replicas.alive(index):
                raise ServerError(label, "exited before its router took it back (its log says why)")
            time.sleep(0.1)   # the router's probes pass about once a second
        if not self.events.watching or not self.replicas.rearm(index, address):   # the job ended first
            return None
        with self._lock:
            self.table.back(index)
        return Joined(address, started_s, row.get("from_step"), stats.get("step"))

    # -- the fleet: a replica that leaves, a resize --------------------------------------------------------------
    def _leave(self, death: ServerDeath) -> None:
        """A dead replica that is not restarted leaves its role (enough others run: `Supervision.leaves`): out of
        its router for good, its remains stopped, one line."""
        index = death.index
        assert index is not None
        try:
            self._retire(index, f"died: {death.one_line()}")
        except (OSError, RuntimeError) as e:
            self.events.fatal(ServerDeath.of(index, ServerError(self.plan.servers[index].label,
                                                                f"died and could not leave its router ({e})")))
            return
        self._gone(index, 0.0, f"died: {death.one_line()}", "died")

    def _retire(self, index: int, reason: str) -> None:
        """Replica `index` out of its router's rotation and weight-sync group for good (its slot a spare again)."""
        from dualrun.servers import router_client

        router, slot = router_of(self.plan, index)
        if index in self._unknown_step:   # its step, before the retire clears it from its router's row
            try:
                self._settle_step(index, router_client.replicas(self.address_of(router) or "")["replicas"][slot])
            except (OSError, ValueError, KeyError, IndexError):
                pass
        router_client.control(self.address_of(router) or "", slot, "retire", reason=reason)

    def _gone(self, index: int, grace_s: float, why: str, summary: str) -> None:
        """Stop what is left of a replica that left its role (`why`, `summary`: its line's and the job summary's)."""
        proc = self.plan.servers[index]
        self.replicas.kill(index, grace_s)
        print(left_line(proc.label, why, self._running(proc.unit), self.plan.fleets[proc.unit].low),
              file=sys.stderr, flush=True)
        with self._lock:
            self.history.append(f"{proc.label} left ({summary})")

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

    # -- hung replicas ---------------------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """The set's watcher calls it every turn: about once a second, `look` (while any replica has restarts); the
        lone servers' prober runs (a thread of its own: a hung server's probe takes `PROBE_TIMEOUT_S`)."""
        if self.table.lone and self.events.watching and (self._prober is None or not self._prober.is_alive()):
            self._prober = threading.Thread(target=self._probe_lone, name="dualrun-server-probe", daemon=True)
            self._prober.start()
        if self.table.supervised and now - self._last_look >= HUNG_EVERY_S:
            self._last_look = now
            self.look(now)

    def look(self, now: float) -> None:
        """Ask each router in front of a supervised replica for its table: a replica found hung is stopped and its
        death reported as being hung, so it is restarted; without a restart left (or no other replica serving) it
        stays out of rotation, routed around."""
        from dualrun.servers import router_client

        for index in self.table.supervised:
            router, slot = router_of(self.plan, index)
            at = self.address_of(router)
            if at is None or index in self.restarting or not self.replicas.alive(index):
                with self._lock:
                    self.table.looked(index, None, now)
                continue
            try:
                row = router_client.replicas(at, timeout_s=2.0)["replicas"][slot]
            except (OSError, ValueError, KeyError, IndexError):
                continue   # the router's own death is the watcher's event
            with self._lock:
                if not self.table.looked(index, row, now):
                    continue
            self._stop_hung(index, row.get("reason") or "out of rotation", f"was hung ({row.get('reason')})")

    def _probe_lone(self) -> None:
        """While the set is watched, about once a second, each lone server's health probe (`PROBE_TIMEOUT_S` to
        answer), judged by the table; one found hung is stopped and its death reported (the job's: it ends naming
        it, or restarts whole with `max_failures`). A server whose process ended is not probed: its end is the
        watcher's event."""
        from dualrun.servers.process import probe

        with self._lock:
            for index in self.table.lone:
                self.table.probing(index, time.monotonic())
        while self.events.watching:
            for index in self.table.lone:
                address = self.address_of(index)
                if address is None or not self.replicas.alive(index):
                    continue
                ok, detail = probe(f"http://{address}{liveness_path(self.plan, index)}", PROBE_TIMEOUT_S)
                with self._lock:
                    now = time.monotonic()
                    said = self.table.heard(index, ok, detail, now)
                    reason = self.table.probed(index, ok, detail, now)
                if said is not None and reason is None:
                    print(said, file=sys.stderr, flush=True)
                if reason is not None and self.events.watching and self.replicas.alive(index):
                    self._stop_hung(index, f"at {address}: {reason}", stopped_answering(address, reason))
            self.events.wait_stopped(PROBE_INTERVAL_S)

    def _stop_hung(self, index: int, reason: str, why: str) -> None:
        """Stop hung server `index` (its line first) and report its death (`why`: after its label)."""
        label = self.plan.servers[index].label
        print(hung_line(label, reason), file=sys.stderr, flush=True)
        tail, log_path = self.replicas.kill(index, HUNG_GRACE_S)
        self.events.report(ServerDeath.of(index, ServerError(label, why, tail, log_path)))
