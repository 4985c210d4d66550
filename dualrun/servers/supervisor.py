"""The one supervisor of a set's engine replicas, on either backend: a death restarted or made the job's, a hung
replica found and stopped, a restarted one taken back by its router (held until it has the trainer's weights), a
lone server (no router in front) probed and, hung, stopped (its death the job's).

Why apart from the server sets: the policy (supervision.py's table) and the steps of a restart (the router's
`remove`, a fresh process, the router's `replace`, the wait for rotation, the lines the user reads) are the same
whether the replica is a process here (`LocalServers`) or runs from a Ray actor (`RayServers`); a backend only
gives the few primitives below (`Replicas`). The multi-machine wrapper (backends/torchrun/machine_servers.py) adds
what only several machines need: the router's view of whether another replica serves. A fleet's resize (`scale`,
`take_in`, `depart`) is the `FleetResize` it inherits (fleet_resize.py), over the same lock and table.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Callable, Collection, Protocol

from dualrun.plan.processes import Plan
from dualrun.programs.rotation import PROBE_INTERVAL_S, PROBE_TIMEOUT_S
# the fleet's resize, its join and its departures (`Joined` and the two constants kept importable from here)
from dualrun.servers.fleet_resize import DRAIN_S, FIRST_REQUEST_EVERY_S, FleetResize, Joined  # noqa: F401
from dualrun.servers.process import ServerError
from dualrun.servers.server_death import ServerDeath
from dualrun.servers.supervision import (HUNG_GRACE_S, Supervision, back_line, held_line, hung_line, left_line,
                                         liveness_path, restarting_line, router_of, stopped_answering)

HUNG_EVERY_S = 1.0   # how often the routers are asked for hung replicas (they probe about once a second)


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


class Supervisor(FleetResize):
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

    # -- the fleet: a replica that leaves (a resize: fleet_resize.py) --------------------------------------------
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
