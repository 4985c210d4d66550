"""Placement groups on the joined cluster: the check that a plan can fit, the request, and the wait.

One implementation for the Ray launcher's ranks, its servers and the role-program groups, so they fail alike: a
placement that can never fit, or that is not met within `ray.placement_timeout_s`, is a layout or resource
problem the user must fix, so it ends with one line and exit code 2 (what was asked, what the cluster has free).
Every wait returns to its caller at least once a second, so a signal (or Ctrl-C) is seen while Ray places.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from dualrun.config.model import RayOptions
from dualrun.contract.errors import ConfigError, LaunchError
from dualrun.backends.ray.connect import alive_nodes

PLACEMENT_EXIT = 2   # a layout or resource problem the user must fix, like any other bad input


def check_resources(source: str, role: str, bundles: list[dict[str, float]]) -> None:
    """Fail with one line (exit 2) when the cluster can never hold these bundles: totals and the largest node."""
    nodes = alive_nodes()
    total = {"GPU": sum(n["Resources"].get("GPU", 0) for n in nodes),
             "CPU": sum(n["Resources"].get("CPU", 0) for n in nodes)}
    want = {k: sum(b.get(k, 0) for b in bundles) for k in ("GPU", "CPU")}
    key = {"GPU": f"roles.{role}.gpus", "CPU": "ray.num_cpus_per_worker"}
    for res in ("GPU", "CPU"):
        if want[res] > total[res] + 1e-9:
            raise ConfigError(source, key[res], f"at most {total[res]:g} {res}s in total (the Ray cluster has "
                              f"{total[res]:g} in {len(nodes)} node(s))", f"{want[res]:g}")
        biggest = max((b.get(res, 0) for b in bundles), default=0)
        best = max((n["Resources"].get(res, 0) for n in nodes), default=0)
        if biggest > best + 1e-9:
            raise ConfigError(source, key[res], f"at most {best:g} {res}s per process (the largest node of the "
                              "Ray cluster has that many)", f"{biggest:g}")


def describe_free() -> str:
    import ray

    free = ray.available_resources()
    total = ray.cluster_resources()
    parts = [f"{k} {free.get(k, 0):g}/{total.get(k, 0):g} free" for k in ("GPU", "CPU") if total.get(k)]
    return f"{len(alive_nodes())} node(s), " + (", ".join(parts) or "no CPUs or GPUs")


def placed(pg: Any, timeout: float, check: Callable[[], None] = lambda: None) -> bool:
    """Whether `pg` is placed within `timeout` s; `check` runs every second meanwhile (so a signal is seen)."""
    import ray

    deadline = time.monotonic() + timeout
    ref = pg.ready()
    ready: list[Any] = []
    while not ready:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, _ = ray.wait([ref], timeout=min(1.0, left))
        check()
    return bool(ready)


def place(options: RayOptions, source: str, name: str, unit: str, bundles: list[dict[str, float]], *,
          what: str = "worker(s)", check: Callable[[], None] = lambda: None, precheck: bool = True) -> Any:
    """One placement group for `unit`, placed: checked against the cluster first (`precheck`), requested with
    `ray.placement_strategy` and waited for at most `ray.placement_timeout_s`. On a timeout, a signal (`check`
    raising) or any error the group is removed before the error goes up: a caller never holds a half-made one.

    PACK is Ray's soft packing: it spreads bundles over nodes when one node cannot hold them, which is the
    "PACK first, SPREAD fallback" the design asks for; STRICT_* strategies are taken as given."""
    from ray.util.placement_group import placement_group, remove_placement_group

    if precheck:
        check_resources(source, unit, bundles)
    pg = placement_group(bundles, strategy=options.placement_strategy, name=name)
    try:
        if not placed(pg, options.placement_timeout_s, check):
            raise LaunchError(f"{source}: role(s) {unit}: {len(bundles)} {what} of {_shape(bundles)} with strategy "
                              f"{options.placement_strategy} could not be placed within ray.placement_timeout_s="
                              f"{options.placement_timeout_s:g} s; the cluster has {describe_free()}. Free resources, "
                              "lower the role's gpus, change ray.placement_strategy or raise the timeout",
                              PLACEMENT_EXIT)
    except BaseException:
        remove_placement_group(pg)
        raise
    return pg


def wait_refs(refs: list[Any], what: str, limit: float, check: Callable[[], None] = lambda: None) -> list[Any]:
    """`ray.get(refs)` that calls `check` every second (so a signal is seen within a second) and gives up
    after `limit` s with one line (a runtime_env that never installs, an actor that never starts...)."""
    import ray

    deadline = time.monotonic() + limit
    while True:
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=1.0)
        check()
        if len(ready) == len(refs):
            return ray.get(refs)
        if time.monotonic() > deadline:
            raise LaunchError(f"the Ray workers did not {what} within {limit:g} s", 1)


def _shape(bundles: list[dict[str, float]]) -> str:
    kinds = sorted({tuple(sorted(b.items())) for b in bundles})
    return " + ".join("{" + ", ".join(f"{k}: {v:g}" for k, v in kind) + "}" for kind in kinds)
