"""The plan's servers, whichever backend starts them: the method's commands put into the plan, the start order,
the addresses, and the trainers' wiring of them.

Why a module of its own: the one-machine set (local.py), the multi-machine coordinator
(backends/torchrun/machine_servers.py) and the Ray set (backends/ray/actor_servers.py) start the same servers from the
same plan; only where and how they run differs.
"""
from __future__ import annotations

from typing import Mapping

from dualrun.plan.optional import joining, optional_machines
from dualrun.plan.processes import AUTO, ROUTER, Plan, Process, spare_start
from dualrun.plan.servers import replicas_of
from dualrun.programs.rotation import SPARE


def server_previews(plan: Plan, host: str, node: int | None = None,
                    devices: str | None = None) -> tuple[tuple[str, tuple[str, ...], dict[str, str]], ...]:
    """What a dry run shows of each server that `node` starts (every node's: None): its label, its command
    (`with_method`'s) and the env it adds. Its port (picked free at launch) is `<auto>`, like `host` and `devices`
    where only the launch knows them (Ray: the actor's node IP and GPUs, for a server that has any); else the
    plan's devices."""
    from dualrun.config.engine_kinds import ENGINES

    out = []
    later = joining(plan)
    for p in plan.servers:
        if node is None or p.node == node:
            assert p.serving is not None
            slots = [SPARE if spare(plan.servers[i]) or i in later else AUTO for i in replicas_of(plan, p.unit)]
            argv = p.serving.argv(host, AUTO, slots if p.kind == ROUTER else ())
            planned = p.env.get("CUDA_VISIBLE_DEVICES", "")
            shown = {"CUDA_VISIBLE_DEVICES": devices if devices is not None and p.devices else planned}
            shown.update({k: p.env[k] for kind in ENGINES.values() for k in kind.weight_env if k in p.env})
            out.append((p.label, tuple(argv), shown))
    return tuple(out)


def phases(plan: Plan) -> list[list[int]]:
    """Indices of `plan.servers` in start order: every engine replica at once, then the routers (which need
    their replicas' addresses)."""
    first = [i for i, p in enumerate(plan.servers) if p.kind != ROUTER]
    routers = [i for i, p in enumerate(plan.servers) if p.kind == ROUTER]
    return [first, routers] if routers else [first]


def facing(plan: Plan) -> list[int]:
    """plan.servers indices of the servers the trainers talk to: each router, and the replica of a unit without one
    (their addresses are the trainers' wiring; several torchrun machines: machine K >= 1 watches those that run
    elsewhere)."""
    routed = {p.unit for p in plan.servers if p.kind == ROUTER}
    return [i for i, p in enumerate(plan.servers) if p.kind == ROUTER or p.unit not in routed]


def replica_addresses(plan: Plan, started: Mapping[int, str], index: int) -> list[str]:
    """For the router at `plan.servers[index]`: the `host:port` of the replicas it stands in front of, in replica
    order (for an engine replica: none)."""
    unit = plan.servers[index].unit
    if plan.servers[index].kind != ROUTER:
        return []
    later = joining(plan)   # several torchrun machines: an optional machine's replicas join when it comes
    return [started.get(i, SPARE) if spare(plan.servers[i]) or i in later else started[i]
            for i in replicas_of(plan, unit)]


def started_when(plan: Plan, label: str) -> str:
    """How a dry run says when the server `label` starts: beside the trainers, or (a spare) by a resize."""
    proc = next((p for p in plan.servers if p.label == label), None)
    if proc is not None and proc.node in optional_machines(plan):
        return f"started with machine {proc.node}, which is optional (it joins the job whenever it is launched)"
    if proc is not None and not proc.placed:   # Ray: no node had room for it when the plan was made
        return "a spare, placed when a node with room joins (not at launch)"
    return f"a spare, started {spare_start(plan)} (not at launch)" if proc is not None and spare(proc) else \
        "started beside the trainers"


def spare(proc: Process) -> bool:
    """A replica above the count its role starts at launch (`dualrun scale` starts it): its router has an empty
    slot for it."""
    return proc.serving is not None and proc.serving.spare


def at_launch(plan: Plan) -> list[list[int]]:
    """`phases` without the spare replicas: what a set starts at launch (an optional machine's, spares or not: all
    its replicas, when it is launched)."""
    later = joining(plan)
    return [[i for i in phase if not spare(plan.servers[i]) or i in later] for phase in phases(plan)]


def awaited(plan: Plan, index: int) -> bool:
    """Whether a router waits for replica `index` before it starts (not a spare, not an optional machine's)."""
    return not spare(plan.servers[index]) and index not in joining(plan)


def addresses(plan: Plan, started: Mapping[int, str]) -> dict[str, str]:
    """role -> host:port for every server role: the plan's servers (by index; a role with several replicas is its
    router's) and the user's own (`address:`)."""
    out = dict(plan.external)
    routed = {p.unit for p in plan.servers if p.kind == ROUTER}
    for index, addr in started.items():
        proc = plan.servers[index]
        if proc.unit in routed and proc.kind != ROUTER:
            continue
        for name in proc.roles:
            out[name] = addr
    return out
