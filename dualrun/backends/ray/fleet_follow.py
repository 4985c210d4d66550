"""On Ray a role's fleet follows the cluster: it grows onto room that appears (a node that joins through `ray start`,
the autoscaler, a spot node), up to its target.

Why a loop of its own: Ray places a placement group as soon as a node has room for it, so a group asked for ahead
of time (*pending*) is how the job learns that room appeared, with nothing to poll but the group. Each resizable
role keeps at most one pending group, shaped like its replicas, while fewer replicas run than its target; once Ray
places it, the next spare starts in it through the supervisor's resize (`FleetResize.scale`: taken in by the router,
held for the trainer's weights where it takes them). The target starts at `max_replicas` (grow whenever there is
room); `dualrun scale` sets it (`RayServers.scale`). A replica whose node leaves is the supervisor's
(`ServerDeath.node_gone`: it leaves its role while `min_replicas` remain); then fewer run than the target and a
pending group waits for room again. The decisions (`step`) are pure; the Ray calls are in `Follower`.

While the trainers' ranks are being placed (each attempt), no room is asked for and a pending group is given back
(`hold`): a group asked for between the servers' start and the ranks' placement would take the room the plan counted
on for a rank, on a cluster with just that much, and the rank would wait for a node that may never come.
"""
from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping

EVERY_S = 1.0    # how often the pending groups are looked at
RETRY_S = 30.0   # after a replica that failed to join: how long before room is asked for again
KEEP, ASK, DROP, GROW = "keep", "ask", "drop", "grow"


def step(running: int, target: int, pending: bool, placed: bool) -> str:
    """What to do for one role: ASK for a pending group (fewer run than the target, none pending), GROW into the
    placed one, DROP the pending one (the target is reached), or KEEP waiting."""
    if running >= target:
        return DROP if pending else KEEP
    if not pending:
        return ASK
    return GROW if placed else KEEP


def gone(node_id: str, nodes: list[Mapping[str, Any]], error: str = "") -> bool:
    """Whether the node `node_id` left the cluster (dead, drained) as `ray.nodes()` (`nodes`) or an actor's death
    (`error`) tell it."""
    if "its node has died" in error or "node was drained" in error or "preempted" in error:
        return True
    row = next((n for n in nodes if n.get("NodeID") == node_id), None)
    return row is not None and not row.get("Alive")


def node_of(pg: Any) -> tuple[str, str]:
    """(ip, node id) of the node Ray placed `pg`'s (one) bundle on."""
    import ray
    from ray.util.placement_group import placement_group_table

    node_id = str(placement_group_table(pg).get("bundles_to_node_id", {}).get(0, ""))
    ip = next((n.get("NodeManagerAddress", "") for n in ray.nodes() if n.get("NodeID") == node_id), "")
    return ip, node_id


@dataclass
class Pending:
    """A role's pending placement group, the one reference that resolves once Ray places it, and whether it did.
    The reference is kept from the ask on: one made at each look (`pg.ready()` is an RPC to the GCS) would be looked
    at with no wait before its reply came, and so would see an unplaced group almost every time (CI saw a joining
    node unused for 300 s)."""

    pg: Any
    ready: Any   # `pg.ready()`, made once at the ask
    placed: bool = False
    told: bool = False   # its line was printed


class Follower:
    """The loop above for one `RayServers`: `servers` gives `watching`, `plan`, `supervisor`, `bundle` and
    `run_id`. `take(unit)` hands a placed group to the replica that starts in it (`RayServers.respawn`)."""

    def __init__(self, servers: Any) -> None:
        self.servers = servers
        plan = servers.plan
        self.targets = {unit: b.high for unit, b in plan.fleets.items() if b.resizable}
        self.pending: dict[str, Pending] = {}
        self._asked = 0
        self._after: dict[str, float] = {}   # unit -> no room asked for before this (a join failed)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._held = False   # the launcher holds it from the set's making until the first ranks are placed

    def hold(self, held: bool) -> None:
        """While `held` (the trainers' ranks being placed) ask for no room, and give back the pending groups."""
        with self._lock:
            self._held = held
        if held:
            self.stop()

    def set_target(self, unit: str, replicas: int) -> None:
        """`dualrun scale`: the role's replicas from now on (within its bounds: the caller checks)."""
        with self._lock:
            self.targets[unit] = replicas

    def start(self) -> None:
        """Begin the loop (once per watch) where any role may grow."""
        if self.targets and (self._thread is None or not self._thread.is_alive()):
            self._thread = threading.Thread(target=self._run, name="dualrun-fleet-follow", daemon=True)
            self._thread.start()

    def take(self, unit: str) -> Any:
        """The role's placed pending group, now the caller's (None when none is placed)."""
        with self._lock:
            held = self.pending.get(unit)
            if held is None or not held.placed:
                return None
            del self.pending[unit]
            return held.pg

    def stop(self) -> None:
        """Remove every pending group (the job ends, or the watch does): nothing is left holding room."""
        from dualrun.backends.ray.gang import remove_groups

        with self._lock:
            groups = [p.pg for p in self.pending.values()]
            self.pending.clear()
        remove_groups(groups)

    def _run(self) -> None:
        servers = self.servers
        told: set[str] = set()   # the failures already printed: one line each, not one per second
        try:
            while servers.watching:
                for unit in list(self.targets):
                    if not servers.watching:
                        break
                    try:
                        self.once(unit)
                    except Exception as e:  # noqa: BLE001 - a Ray call that failed once (a busy GCS) must not end
                        line = f"dualrun: {unit}: a look for room on the cluster failed ({type(e).__name__}: {e})"
                        if line not in told:   # the loop: the fleet would stop following the cluster unsaid
                            told.add(line)
                            print(f"{line}; looking again every {EVERY_S:g} s", file=sys.stderr, flush=True)
                servers.wait_stopped(EVERY_S)
        finally:
            self.stop()

    def once(self, unit: str) -> None:
        """One look at `unit`: ask for, drop, or grow into its pending group."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        running = self.servers.supervisor.fleets().get(unit, {}).get("replicas", 0)
        with self._lock:
            held, target = self.pending.get(unit), self.targets[unit]
        if held is not None and not held.placed:
            ready, _ = ray.wait([held.ready], timeout=0)
            held.placed = bool(ready)
        todo = step(running, target, held is not None, held is not None and held.placed)
        if todo == DROP:
            with self._lock:
                self.pending.pop(unit, None)
            remove_placement_group(held.pg)
        elif todo == ASK and time.monotonic() >= self._after.get(unit, 0.0) and not self._held:
            self._asked += 1
            shape = self.servers.bundle(self.servers.plan.servers[self._spare_of(unit)])
            pg = placement_group([shape], name=f"{self.servers.run_id}-{unit}-room-{self._asked}")
            with self._lock:
                held_now = self._held
                if not held_now:
                    self.pending[unit] = Pending(pg, pg.ready())
            if held_now:   # `hold` came meanwhile: the ranks are placed first
                remove_placement_group(pg)
        elif todo == GROW:
            self._grow(unit, held, running, target)

    def _spare_of(self, unit: str) -> int:
        from dualrun.plan.servers import replicas_of

        return replicas_of(self.servers.plan, unit)[-1]

    def _grow(self, unit: str, held: Pending, running: int, target: int) -> None:
        """Room appeared for `unit`: its line (once), then one more replica through the supervisor's resize; one
        refused because another resize runs is tried again on the next look."""
        from dualrun.contract.errors import ScaleCutShort, ScaleRefused

        if not held.told:
            held.told = True
            ip, node_id = node_of(held.pg)
            print(f"dualrun: {unit}: the cluster has room for another replica on node {ip} ({node_id[:8]}); "
                  f"starting one there ({running} run, target {target})", file=sys.stderr, flush=True)
        try:
            self.servers.supervisor.scale(unit, running + 1)
        except ScaleRefused as e:
            if "another resize" not in str(e):   # it did not join: its group was given back (`_park`)
                self._after[unit] = time.monotonic() + RETRY_S
                print(f"dualrun: {e}; room is asked for again in {RETRY_S:g} s", file=sys.stderr, flush=True)
        except ScaleCutShort:
            pass   # the job ended while it joined: the watch ends with it (`_run`), its groups removed

