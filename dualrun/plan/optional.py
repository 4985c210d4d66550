"""Several torchrun machines: the serving machines a job may start without, and the replicas that come and go with
them.

Why apart: on machines started by hand, a role's fleet (`min_replicas` below `max_replicas`) moves by machines, not
by `dualrun scale`: a serving machine (no trainer ranks) whose every replica is above its role's `min_replicas` is
*optional*. Machine 0 starts the job without it; launched later (the same `dualrun launch` with its machine_rank)
it joins and adds its replicas; stopped (SIGTERM) or lost, it takes them away while `min_replicas` others remain.
Kept as pure functions of the plan, so the plan's table, the refusal and every server set read one answer.
"""
from __future__ import annotations

from typing import Any, Mapping

from dualrun.contract.errors import ConfigError
from dualrun.plan.servers import ROUTER, replicas_of


def _several(plan: Any) -> bool:
    r = plan.rendezvous
    return r is not None and r.per_machine and r.num_machines > 1


def _slot(plan: Any, index: int) -> int:
    return replicas_of(plan, plan.servers[index].unit).index(index)


def _above_min(plan: Any, index: int) -> bool:
    """Replica `index` of a resizable fleet, above the `min_replicas` its role keeps."""
    p = plan.servers[index]
    fleet = plan.fleets.get(p.unit)
    return p.kind != ROUTER and fleet is not None and fleet.resizable and _slot(plan, index) >= fleet.low


def optional_machines(plan: Any) -> dict[int, tuple[int, ...]]:
    """machine -> its replicas (plan.servers indices), for each serving machine of a several-machine torchrun plan
    whose every server is above its role's `min_replicas` (none where the plan is not one)."""
    if not _several(plan):
        return {}
    with_ranks = {p.node for p in plan.workers}
    mine: dict[int, list[int]] = {}
    for i, p in enumerate(plan.servers):
        mine.setdefault(p.node, []).append(i)
    return {k: tuple(ix) for k, ix in sorted(mine.items())
            if k not in with_ranks and k != 0 and all(_above_min(plan, i) for i in ix)}


def joining(plan: Any) -> frozenset[int]:
    """plan.servers indices of the replicas on optional machines: started with their machine, whenever it comes."""
    return frozenset(i for ix in optional_machines(plan).values() for i in ix)


def machine_of_fleet(plan: Any) -> frozenset[str]:
    """The units whose fleet moves by machines (several torchrun machines), not by `dualrun scale`."""
    return frozenset(plan.servers[i].unit for i in joining(plan))


def refuse_placement(cfg: Any, plan: Any, fleets: Mapping[str, Any]) -> None:
    """Several torchrun machines: a fleet's replicas above `min_replicas` must sit on optional serving machines
    (machine 0 has no way to start or stop one elsewhere, and machines with ranks keep their fixed rules); one line
    naming the key and the first replica that does not."""
    if not _several(plan):
        return
    optional = joining(plan)
    for i, p in enumerate(plan.servers):
        fleet = fleets.get(p.unit)
        if fleet is None or (fleet.low, fleet.high) == (fleet.start, fleet.start) or i in optional \
                or not _above_min(plan, i):
            continue
        role = cfg.role(p.roles[0])
        key = "min_replicas" if role is not None and role.min_replicas is not None else "max_replicas"
        where = "ranks run" if p.node in {w.node for w in plan.workers} or p.node == 0 else \
            "a replica the job needs runs too"
        raise ConfigError(cfg.source, f"roles.{p.roles[0]}.{key}", f"the replicas above min_replicas ({fleet.low}) "
                          "on optional serving machines (no ranks, no replica below min_replicas)",
                          getattr(role, key, None), f"{plan.rendezvous.num_machines} torchrun machines: {p.label} is "
                          f"on machine {p.node}, where {where}")
