"""Which of a set's engine replicas are restarted, stopped as hung, or end the job: the policy as a table of values.

Why a table apart from the processes: what happens when a replica dies, hangs or stops answering is the whole of
the launcher's fault tolerance for servers; kept here as plain data with the clock passed in, every rule is
unit-tested in milliseconds, and both backends' sets (and the machines of a multi-machine job) follow the same
rules through one driver (supervisor.py).

The rules. A replica may be restarted when it stands behind a router (its role has several engines), restarts of
it are left (`roles.<r>.replica_restarts`, the plan's `Serving.restarts`: the budget is a value of the plan), and
another replica of its role is still serving (the last one gone ends the job). A set restarts the replicas it runs
(on several machines, each machine its own). A replica is *hung* when its router took it out for a request that got
no answer, or its health probes have failed for `request_timeout_s` while its process lives
(`rotation.judge`, the one reading of the router's table that the router's rules write): it is stopped and
restarted like a dead one. A *lone* server (a role of one engine: no router in front, the trainers' only server of
its role; and a router, which nothing else probes, on its table's path) is probed by its set the way a router probes a replica, its probes kept in a one-slot table of the router's
(`Rotation`) and read by the same `judge`: failing them for `request_timeout_s` while its process lives, it is hung,
stopped like a dead one, and its death is the job's (it ends naming it, or restarts whole with `max_failures`).
Another machine's server that misses `MISSES` health checks in a row is dead, unless its
own machine is restarting it. A role's fleet (`Plan.fleets`) may shrink and grow between `min_replicas` and
`max_replicas`: a replica above the count started at launch is *parked* (a spare: placed, not running) until a
resize starts it; one resized away is parked again; a dead replica that is not restarted (its restarts spent, or
none) *leaves* instead of ending the job while at least `min_replicas` of its role still run. A replica whose engine takes the trainer's weights (`Serving.takes_weights`, a rollout
on vLLM) comes back *held*: its router keeps it out of rotation until its first weight update completes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Collection, Mapping

from dualrun.plan.processes import ROUTER, Plan
from dualrun.plan.servers import replicas_of
from dualrun.programs.rotation import HUNG, RESTARTING, Rotation, judge

SILENT_LINE_S = 5.0  # a lone server unanswered this long gets a line (judged hung only after request_timeout_s)
HUNG_GRACE_S = 5.0   # a hung replica's SIGTERM -> SIGKILL (a SIGSTOPped one takes only the SIGKILL)
MISSES = 2           # another machine's server: failed health checks in a row that are a death


def restart_budget(plan: Plan, mine: Collection[int] | None = None) -> dict[int, int]:
    """plan.servers index -> restarts allowed, for every engine replica that may be restarted at all (of `mine`,
    when given): one behind a router whose role allows restarts."""
    return {i: p.serving.restarts for i, p in enumerate(plan.servers)
            if p.serving is not None and p.serving.restarts > 0 and (mine is None or i in mine)}


def restartable(plan: Plan) -> frozenset[int]:
    """Every machine's replicas that are restarted at all (by the machine that runs them)."""
    return frozenset(restart_budget(plan))


def lone(plan: Plan, mine: Collection[int] | None = None) -> list[int]:
    """plan.servers indices of the servers nothing else probes (of `mine`, when given): each router, and each
    engine with no router in front; their set probes them itself."""
    routed = {p.unit for p in plan.servers if p.kind == ROUTER}
    return [i for i, p in enumerate(plan.servers) if (p.kind == ROUTER or p.unit not in routed)
            and p.serving is not None and (mine is None or i in mine)]


def liveness_path(plan: Plan, index: int) -> str:
    """Where server `index` is probed for being alive: a router's table (its `/health` is 503 while no replica is in
    rotation, which is its replicas' state, not its own), an engine's health path."""
    from dualrun.programs.routing import STATS_PATH

    proc = plan.servers[index]
    return STATS_PATH if proc.kind == ROUTER else proc.serving.health_path   # type: ignore[union-attr]


def router_of(plan: Plan, index: int) -> tuple[int, int]:
    """(plan.servers index of the router in front of replica `index`, the replica's slot in that router)."""
    unit = plan.servers[index].unit
    router = next(i for i, p in enumerate(plan.servers) if p.unit == unit and p.kind == ROUTER)
    return router, replicas_of(plan, unit).index(index)



def survivable(plan: Plan, index: int | None, left: Mapping[int, int], down: Collection[int]) -> bool:
    """Whether the death of `plan.servers[index]` is survived by restarting it: restarts left, and another replica
    of its unit is neither dead nor being restarted (`down`)."""
    if index is None or left.get(index, 0) <= 0:
        return False
    return any(i not in down for i in replicas_of(plan, plan.servers[index].unit) if i != index)


def hung(row: Mapping[str, Any], out_for_s: float, request_timeout_s: float) -> bool:
    """Whether the router's row (`router_client.replicas`) shows a hung replica (`rotation.judge`)."""
    return judge(row, out_for_s, request_timeout_s) == HUNG


def restarting(row: Mapping[str, Any]) -> bool:
    """Whether the router's row shows a replica its launcher is restarting (taken out, or joining at a fresh
    address: `rotation.judge`)."""
    return judge(row, 0.0, float("inf")) == RESTARTING


@dataclass
class Supervision:
    """One set's replicas under the rules above: the restarts left, the replicas being restarted, since when each
    is out of rotation (as the launcher saw it) and the misses of another machine's servers. Not thread-safe: its
    driver (supervisor.py) holds a lock around each call."""

    plan: Plan
    allowed: dict[int, int]                             # the budget: plan.servers index -> restarts allowed
    left: dict[int, int] = field(default_factory=dict)  # ... -> restarts left
    down: set[int] = field(default_factory=set)         # being restarted
    out_since: dict[int, float] = field(default_factory=dict)   # out of rotation since (the launcher's clock)
    misses: dict[int, int] = field(default_factory=dict)        # another machine's server -> missed checks in a row
    alone: dict[int, Rotation] = field(default_factory=dict)    # a lone server -> its probes, as a router holds them
    answered_at: dict[int, float] = field(default_factory=dict) # a lone server -> its last answer (or first probe)
    silent: set[int] = field(default_factory=set)               # lone servers whose silence was told
    parked: set[int] = field(default_factory=set)               # spare replicas, not running (a resize starts one)
    # several torchrun machines: the replicas this set may see leave (its own, and those of optional machines,
    # which come and go with their machine: plan/optional.py); None: every replica
    leavers: frozenset[int] | None = None

    @classmethod
    def of(cls, plan: Plan, mine: Collection[int] | None = None) -> "Supervision":
        """The replicas of `plan` this set runs (`mine`; None: all), each with its full budget."""
        from dualrun.plan.optional import joining

        allowed = restart_budget(plan, mine)
        later = joining(plan)   # an optional machine's replicas: running there, parked elsewhere until it comes
        spares = {i for i, p in enumerate(plan.servers) if p.serving is not None and p.serving.spare
                  and (mine is None or i in mine) and i not in later}
        spares |= {i for i in later if mine is not None and i not in mine}
        leavers = None if mine is None else frozenset(mine) | later
        return cls(plan, allowed, dict(allowed), alone={i: Rotation([plan.servers[i].label]) for i in lone(plan, mine)},
                   parked=spares, leavers=leavers)

    @property
    def supervised(self) -> list[int]:
        """The replicas restarts are left for: the ones looked at for being hung."""
        return list(self.left)

    def used(self, index: int) -> int:
        """Restarts of `index` so far."""
        return self.allowed.get(index, 0) - self.left.get(index, 0)

    def died(self, index: int | None, others_serving: bool) -> bool:
        """Server `index` died (or was stopped as hung): True when it is restarted (one of its restarts is used and
        it is down until `back`), False when the job does not survive it. `others_serving`: whether, beyond this
        table's view, another replica of its role may still serve (several machines: its router's view)."""
        if index not in self.left or not others_serving or \
                not survivable(self.plan, index, self.left, self.down | self.parked):
            return False
        self.left[index] -= 1
        self.down.add(index)
        return True

    def back(self, index: int) -> None:
        """The restarted replica serves again: its next death is judged like the first."""
        self.down.discard(index)

    # -- the fleet ---------------------------------------------------------------------------------------------
    def running(self, unit: str) -> list[int]:
        """`unit`'s replicas that run or are being restarted (not parked), in slot order."""
        return [i for i in replicas_of(self.plan, unit) if i not in self.parked]

    def in_fleet(self, index: int | None) -> bool:
        """Whether `index` is a replica of a resizable role (one that may leave it instead of ending the job)."""
        if index is None:
            return False
        fleet = self.plan.fleets.get(self.plan.servers[index].unit)
        return fleet is not None and fleet.resizable and self.plan.servers[index].kind != ROUTER and \
            (self.leavers is None or index in self.leavers)

    def leaves(self, index: int | None, others_serving: bool) -> bool:
        """A replica that died and is not restarted (`died` said False): True when it leaves its role instead of
        ending the job — its role keeps at least `min_replicas` running, another of them serving — and it is
        parked now."""
        if index is None or index in self.parked or not others_serving or not self.in_fleet(index):
            return False
        unit = self.plan.servers[index].unit
        rest = [i for i in self.running(unit) if i != index]
        if len(rest) < self.plan.fleets[unit].low or not any(i not in self.down for i in rest):
            return False
        self.parked.add(index)
        self.down.discard(index)
        return True

    def to_start(self, unit: str, count: int) -> list[int]:
        """Which parked replicas a resize up by `count` starts: the lowest slots first; each leaves `parked` and is
        `down` (starting) until `back`."""
        chosen = [i for i in replicas_of(self.plan, unit) if i in self.parked][:count]
        self.parked.difference_update(chosen)
        self.down.update(chosen)
        return chosen

    def to_stop(self, unit: str, count: int) -> list[int]:
        """Which running replicas a resize down by `count` stops: the highest slots not being restarted; each is
        parked at once (its end is no death)."""
        chosen = [i for i in reversed(self.running(unit)) if i not in self.down][:count]
        self.parked.update(chosen)
        return chosen

    def supervises(self, index: int | None) -> bool:
        """Whether `index` is one of the replicas this set restarts (restarts left or not)."""
        return index in self.left

    def looked(self, index: int, row: Mapping[str, Any] | None, now: float) -> bool:
        """One look at replica `index`: its router's row, or None when it was not looked at (its process ended, it
        is being restarted, or its router is not known here yet). True when it is hung and to be stopped and
        restarted (the job survives that)."""
        if row is None or index in self.down or row.get("in_rotation"):
            self.out_since.pop(index, None)
            return False
        out_for = now - self.out_since.setdefault(index, now)
        request_timeout = self.plan.servers[index].serving.request_timeout_s   # type: ignore[union-attr]
        if not hung(row, out_for, request_timeout) or \
                not survivable(self.plan, index, self.left, self.down | self.parked):
            return False
        self.out_since.pop(index, None)
        return True

    @property
    def lone(self) -> list[int]:
        """The lone servers this set probes (one judged hung is probed no more)."""
        return list(self.alone)

    def probing(self, index: int, now: float) -> None:
        """Probes of lone server `index` begin (again): what earlier ones said is forgotten."""
        if index in self.alone:
            self.alone[index] = Rotation([self.plan.servers[index].label])
            self.answered_at[index] = now
            self.silent.discard(index)

    def heard(self, index: int, ok: bool, detail: str, now: float) -> str | None:
        """One health probe of lone server `index`, for the user: the line to print, once, when it has not answered
        for `SILENT_LINE_S` (the job waits on it until `request_timeout_s` judges it hung: without the line a
        stopped server looks like a slow step), and once when it answers again; else None."""
        label = self.plan.servers[index].label
        if ok:
            since = self.answered_at.get(index, now)
            self.answered_at[index] = now
            if index in self.silent:
                self.silent.discard(index)
                return f"dualrun: {label} answers its health check again, after {now - since:.0f} s"
            return None
        silent_for = now - self.answered_at.setdefault(index, now)
        if index in self.silent or silent_for < SILENT_LINE_S:
            return None
        self.silent.add(index)
        limit = self.plan.servers[index].serving.request_timeout_s   # type: ignore[union-attr]
        return (f"dualrun: {label} has not answered its health check for {silent_for:.0f} s ({detail}); the job "
                f"waits on it and judges it hung after request_timeout_s ({limit:g} s)")

    def probed(self, index: int, ok: bool, detail: str, now: float) -> str | None:
        """One health probe of lone server `index` (`detail`: what it got), taken as a router takes a replica's: a
        failed one takes it out of its one-slot rotation, `RECOVER_PROBES` passing ones in a row bring it back. Why
        it is hung (`judge`: failing its probes for `request_timeout_s`, and this one too), once; else None."""
        table = self.alone.get(index)
        if table is None:
            return None
        table.probed(0, ok, detail, now)
        row = table[0]
        out_for = 0.0 if row.out_since is None else now - row.out_since
        limit = self.plan.servers[index].serving.request_timeout_s   # type: ignore[union-attr]
        if ok or judge(row, out_for, limit) != HUNG:   # one that answers is not hung, even before it is back in
            return None
        del self.alone[index]
        return f"{row.reason}; its health probes failed for {out_for:.1f} s, request_timeout_s is {limit:g}"

    def checked(self, index: int, answered: bool) -> bool:
        """Another machine's server answered its health check (or its machine is restarting it: `restarting`) or
        not. True when it is dead: `MISSES` misses in a row."""
        self.misses[index] = 0 if answered else self.misses.get(index, 0) + 1
        return self.misses[index] >= MISSES

    @property
    def missing(self) -> bool:
        """Whether a server of another machine missed a check but not yet `MISSES` (a second look decides)."""
        return any(0 < n < MISSES for n in self.misses.values())


def restarting_line(death_line: str, used: int, allowed: int) -> str:
    """The launch's line when a replica died and is restarted."""
    return f"dualrun: {death_line}; restarting it on the same devices (restart {used} of {allowed}, replica_restarts)"


def hung_line(label: str, reason: str) -> str:
    """The launch's line when a hung replica is stopped to be restarted."""
    return f"dualrun: {label} is hung ({reason}); stopping it (SIGTERM, then SIGKILL after {HUNG_GRACE_S:g} s)"


def stopped_answering(address: str, reason: str) -> str:
    """The reason a hung lone server ended the job (after its label)."""
    return f"at {address} stopped answering while the job was running ({reason}); it was stopped"


def held_line(label: str, address: str, started_s: float | None = None, again: bool = True) -> str:
    """The launch's line when a restarted (`again`) or a joining replica that takes the trainer's weights is
    healthy (its engine's start-up `started_s`), held by its router."""
    took = f"; its engine started in {started_s:.1f} s while the others served" if started_s is not None else ""
    return (f"dualrun: {label} is healthy{' again' if again else ''} at {address}; out of rotation until it holds "
            f"the trainer's weights (it joins the weight-sync group at the next sync){took}")


def back_line(label: str, address: str, seconds: float, started_s: float | None = None) -> str:
    """The launch's line when the restarted replica is back in its router's rotation (and its engine's start-up,
    while the others served)."""
    took = f" (its engine started in {started_s:.1f} s while the others served)" if started_s is not None else ""
    return f"dualrun: {label} is back in rotation at {address}, {seconds:.1f} s after it died{took}"


def serving_from(step: int | None, last: int | None = None) -> str:
    """From which of the trainer's steps a replica that joined serves, in words: its router's `from_step` (a
    rollout's first weight update's: known as it enters rotation); else (a teacher: the step of the trainer's next
    request, which nothing tells before it comes) the trainer's next request, and the step of its last one
    (`last`, the router's) when the router heard one."""
    if step is not None:
        return f"serving from step {step}"
    return "serving from the trainer's next request" + (f" (its last was of step {last})" if last is not None else "")


def joined_line(label: str, address: str, step: int | None, seconds: float, started_s: float,
                last: int | None = None) -> str:
    """The launch's line when a replica a resize started serves (in its router's rotation)."""
    return (f"dualrun: {label} joined at {address}, {serving_from(step, last)}, {seconds:.1f} s after the resize "
            f"asked for it (its engine started in {started_s:.1f} s while the others served)")


def machine_joined_line(label: str, address: str, machine: int, step: int | None, seconds: float, running: int,
                        high: int, last: int | None = None) -> str:
    """The launch's line when an optional machine's replica serves (several torchrun machines)."""
    return (f"dualrun: {label} joined at {address} with machine {machine}, {serving_from(step, last)}, "
            f"{seconds:.1f} s after machine {machine} offered it; {running} of max {high} replicas run")


def joined_summary(label: str, step: int | None, seconds: float, how: str) -> str:
    """A join, for the job's summary (`how`: after what the seconds count, and what else is known); `step` None:
    the trainer asked nothing of it (or its requests carried no step) while the job ran."""
    serving = f"serving from step {step}" if step is not None else \
        "its step unknown (no request of the trainer's that carried one reached it)"
    return f"{label} joined {seconds:.1f} s {how}, {serving}"


def left_line(label: str, why: str, running: int, low: int) -> str:
    """The launch's line when a replica leaves its role (resized away, or dead and not restarted)."""
    return f"dualrun: {label} left ({why}); {running} of min {low} remain"
