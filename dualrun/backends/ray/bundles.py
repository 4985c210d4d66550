"""What a plan asks of a Ray cluster: each actor's bundle, the embedded cluster's size, and whether it can fit.

Why apart from the launcher: these are pure functions of the config and the plan (no Ray calls), shared by the
launcher, the server set and the embedded cluster's start, and tested without a cluster. Every actor of a plan
lives at once (the servers stay up while the trainers run), so a cluster whose totals cannot hold all of them
would leave the last placement waiting `ray.placement_timeout_s` for resources that never come.
"""
from __future__ import annotations

import math
from typing import Any

from dualrun.contract.errors import ConfigError
from dualrun.plan.processes import ROUTER, Plan, Process, make_plan

_KINDS = {"worker": "rank", "server": "server", ROUTER: "router"}


def bundle_of(options: Any, p: Process) -> dict[str, float]:
    """One actor's resources: a rank holds one GPU (if it has one) and `ray.num_cpus_per_worker` CPUs; an engine
    replica holds its GPUs (a spare planned unplaced: those it takes where room appears), or at least one CPU when
    it has none; a router holds CPUs only. `options`: the config's `ray:` section."""
    cpus = options.num_cpus_per_worker
    if p.kind == "server":
        return {"GPU": float(p.gpus)} if p.gpus else {"CPU": max(cpus, 1.0)}
    out = {"CPU": float(cpus)} if cpus else {}
    if p.devices:
        out["GPU"] = 1.0
    return out or {"CPU": 0.001}


def demand(options: Any, plan: Plan, spares: bool = False) -> dict[str, float]:
    """CPUs and GPUs every actor of the plan holds at once at launch; with `spares`, a fleet's spares too (they
    start once the cluster has room for them, backends/ray/fleet_follow.py)."""
    total = {"CPU": 0.0, "GPU": 0.0}
    for p in plan.processes:
        if p.serving is not None and p.serving.spare and not spares:
            continue
        for res, amount in bundle_of(options, p).items():
            total[res] = total.get(res, 0.0) + amount
    return total


def embedded_cpus(cfg: Any) -> int:
    """Logical CPUs to declare for an embedded cluster: every actor of the plan at once (ranks, every engine
    replica, routers), planned on the cluster the config implies; a count for Ray's bookkeeping, not cores. A
    fleet's spares count too: the fleet grows to `max_replicas` right after launch (docs/fleets.md)."""
    return max(1, math.ceil(demand(cfg.ray, make_plan(cfg), spares=True)["CPU"] - 1e-9))


def _who(plan: Plan) -> str:
    counts: dict[str, int] = {}
    for p in plan.processes:
        key = f"{p.unit} {_KINDS.get(p.kind, p.kind)}"
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} {k}{'s' if n > 1 else ''}" for k, n in counts.items())


def check_fits(plan: Plan) -> None:
    """One line (exit 2) when the plan's cluster cannot hold every actor of the plan at once (its totals)."""
    cluster, job = plan.cluster, plan.rendezvous
    assert job is not None
    want = demand(job.options, plan)
    have = {"CPU": sum(n.cpus for n in cluster.nodes), "GPU": float(sum(n.gpus for n in cluster.nodes))}
    for res, key in (("GPU", "roles"), ("CPU", "ray.num_cpus_per_worker")):
        if want[res] > have[res] + 1e-6:
            raise ConfigError(job.source, key, f"at most {have[res]:g} {res}s held at once by the plan's actors (the "
                              f"Ray cluster has {have[res]:g} in {len(cluster.nodes)} node(s))", f"{want[res]:g}",
                              hint=f"the plan: {_who(plan)}")
