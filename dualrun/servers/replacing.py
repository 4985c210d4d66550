"""Which dead engine replicas a job survives: the pure rules behind `roles.<r>.replica_restarts`.

Why a module of its own: the server sets (processes or Ray actors) restart a dead replica and the router
takes it back (dualrun/programs/rotation.py); whether a death is survivable at all, and the one line each event prints, are the same
rules for every backend and unit-testable without a process.

A replica may be restarted when it stands behind a router (its role has several engines), restarts of it are left,
and another replica of its role is still serving (the last one gone ends the job). A replica whose engine
takes the trainer's weights (a `rollout` on vLLM) is held out of rotation until it has them (`takes_weights`; both
backends, through ServerSet._restart): the launcher `remove`s the dead one at its router (the next sync re-forms the weight-sync group without it), `replace`s it with `hold` once healthy, and the router restores it after
its first completed weight update (programs/rotation.py; the trainer's side: dualrun/weightsync/trainer/regroup.py). A teacher or reward
model keeps static weights: back in rotation once healthy.
"""
from __future__ import annotations

from typing import Any, Collection, Mapping

from dualrun.plan.engines import role_takes_weights
from dualrun.plan.processes import ROUTER, Plan, Process

HUNG_GRACE_S = 5.0   # a hung replica's SIGTERM -> SIGKILL (a SIGSTOPped one takes only the SIGKILL)


def takes_weights(cfg: Any, proc: Process) -> bool:
    """`role_takes_weights` of the replica `proc`."""
    return role_takes_weights(cfg, cfg.role(proc.roles[0]))


def restart_budget(cfg: Any, plan: Plan) -> dict[int, int]:
    """plan.servers index -> restarts allowed, for every engine replica that may be restarted at all: one behind a
    router whose role allows restarts (a replica that takes the trainer's weights is restarted held: `takes_weights`)."""
    routed = {p.unit for p in plan.servers if p.kind == ROUTER}
    budget = {}
    for index, proc in enumerate(plan.servers):
        if proc.kind == ROUTER or proc.unit not in routed:
            continue
        role = cfg.role(proc.roles[0])
        if role is not None and role.replica_restarts > 0:
            budget[index] = role.replica_restarts
    return budget


def survivable(plan: Plan, index: int | None, left: Mapping[int, int], down: Collection[int]) -> bool:
    """Whether the death of `plan.servers[index]` is survived by restarting it: restarts left, and another replica
    of its unit is neither dead nor being restarted (`down`)."""
    if index is None or left.get(index, 0) <= 0:
        return False
    unit = plan.servers[index].unit
    others = [i for i, p in enumerate(plan.servers) if p.unit == unit and p.kind != ROUTER and i != index]
    return any(i not in down for i in others)


def hung(row: Mapping[str, Any], out_for_s: float, request_timeout_s: float) -> bool:
    """Whether the router's row (`router_client.replicas`) shows a hung replica: out for `timeout` (a request got
    no answer within `request_timeout_s`), or its health probes failing for that long (`out_for_s`, as the launcher
    saw it) while the process lives (a stopped one answers nothing)."""
    from dualrun.programs.rotation import PROBE, TIMEOUT

    if row.get("in_rotation"):
        return False
    return row.get("kind") == TIMEOUT or (row.get("kind") == PROBE and out_for_s >= request_timeout_s)


def hung_line(label: str, reason: str) -> str:
    """The launch's line when a hung replica is stopped to be restarted."""
    return f"dualrun: {label} is hung ({reason}); stopping it (SIGTERM, then SIGKILL after {HUNG_GRACE_S:g} s)"


def router_of(plan: Plan, index: int) -> tuple[int, int]:
    """(plan.servers index of the router in front of replica `index`, the replica's slot in that router)."""
    unit = plan.servers[index].unit
    replicas = [i for i, p in enumerate(plan.servers) if p.unit == unit and p.kind != ROUTER]
    router = next(i for i, p in enumerate(plan.servers) if p.unit == unit and p.kind == ROUTER)
    return router, replicas.index(index)


def restarting_line(death_line: str, used: int, allowed: int) -> str:
    """The launch's line when a replica died and is restarted."""
    return f"dualrun: {death_line}; restarting it on the same devices (restart {used} of {allowed}, replica_restarts)"


def held_line(label: str, address: str) -> str:
    """The launch's line when a restarted replica that takes the trainer's weights is healthy, held by its router."""
    return (f"dualrun: {label} is healthy again at {address}; out of rotation until it holds the trainer's weights "
            "(it joins the weight-sync group at the next sync)")


def back_line(label: str, address: str, seconds: float) -> str:
    """The launch's line when the restarted replica is back in its router's rotation."""
    return f"dualrun: {label} is back in rotation at {address}, {seconds:.1f} s after it died"
