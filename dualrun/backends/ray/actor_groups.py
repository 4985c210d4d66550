"""Ray execution of a group: one placement group per unit (a role, or colocated roles), one actor per worker.

Each actor (dualrun/backends/ray/actors/role_actor.py) holds one instance of the worker class and serves calls by name. Payloads are
put in the object store by the driver (one object per distinct share) and passed boxed, so each actor pulls only the
share it was given.
"""
from __future__ import annotations

import os
from typing import Any, Callable

from dualrun.backends.ray.actors.role_actor import RoleActor
from dualrun.role_programs.context import RemoteFailure, WorkerError, method_name
from dualrun.role_programs.dispatch import CollectFn
from dualrun.role_programs.modes import GroupsMode
from dualrun.role_programs.workers import Calls, GroupFuture, Workers
from dualrun.light.ports import free_port
from dualrun.role_programs.rendezvous import member_env
from dualrun.role_programs.spec import GroupSpec, RolesSpec

# A worker with one GPU asks for this fraction of its bundle's GPU: the placement group already reserves the
# role's GPUs, and a small share lets colocated roles (and several classes of one role) sit on the same GPU.
GPU_SHARE = 0.01
CPU_SHARE = 0.01


def spec_timeout(runtime: Any) -> float:
    return max(60.0, float(runtime.spec.ray.placement_timeout_s))


def _bundle_cpus(spec: RolesSpec) -> float:
    return max(spec.ray.num_cpus_per_worker, CPU_SHARE)


def ensure_ray(spec: RolesSpec) -> Any:
    """Join (or start) Ray by the Ray backend's address rules; the Connection to close, None if already up."""
    import math

    import ray

    from dualrun.backends.ray.cluster import connect

    if ray.is_initialized():
        return None
    workers = max(1, sum({g.unit_name: g.size for g in spec.groups}.values()))
    return connect(spec.ray, spec.source, num_cpus=max(1, math.ceil(workers * _bundle_cpus(spec))))


def make_placement(spec: RolesSpec, group: GroupSpec, gang: Any) -> Any:
    """The placement group of `group`'s unit, placed by `gang` (a backends.ray.cluster.Gang, which removes it again): one
    bundle per worker, waited for with the configured timeout (the Ray layer's placement: the same message and
    exit code as the launcher's)."""
    per_worker = group.gpus / group.size if group.gpus else 0
    bundle: dict[str, float] = {"CPU": _bundle_cpus(spec)}
    if per_worker:
        bundle["GPU"] = per_worker
    return gang.place(f"dualrun-{group.unit_name}-{os.getpid()}", group.unit_name,
                      [dict(bundle) for _ in range(group.size)], precheck=False)


class RayWorkers(Workers):
    """The actors of one group, placed in its unit's placement group (one bundle per rank)."""

    backend = "ray"

    def __init__(self, runtime: Any, spec: GroupSpec, factory: Callable[..., Any], args: tuple,
                 kwargs: dict) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from dualrun.backends.ray.cluster import Gang

        self.spec, self.factory = spec, factory
        pg = runtime.placement(spec)   # the unit's, shared with colocated groups: the runtime removes it
        per_worker = spec.gpus / spec.size if spec.gpus else 0
        num_gpus = 0 if not per_worker else (GPU_SHARE if per_worker <= 1 else per_worker)
        self.gang = Gang(runtime.spec.ray, runtime.spec.source)
        # the group's own rendezvous: rank 0's bundle names the address before any worker starts
        where = ray.remote(num_cpus=CPU_SHARE, max_retries=0)(pick_address).options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0))
        self.master = ray.get(where.remote(), timeout=spec_timeout(runtime))
        for rank in range(spec.size):
            env = member_env(runtime.spec.env, spec, rank, self.master)
            self.gang.spawn(RoleActor, pg, rank, factory, spec.name, rank, spec.size, env, args, kwargs,
                            runtime.track_bytes, num_cpus=CPU_SHARE, num_gpus=num_gpus, max_concurrency=1)

    def _get(self, refs: list, ranks: list[int], method: str, timeout: float | None = None) -> list:
        import ray
        from ray.exceptions import GetTimeoutError, RayError

        try:
            return ray.get(refs, timeout=timeout)
        except GetTimeoutError:
            raise TimeoutError(f"{self.spec.name}.{method}: no result within {timeout} s") from None
        except RayError:
            for rank, ref in zip(ranks, refs):
                try:
                    ray.get(ref)
                except RayError as e:
                    text = str(e)
                    raise WorkerError(self.spec.name, rank, method,
                                      RemoteFailure(type(e).__name__, text.strip().splitlines()[0], text)) from None
            raise

    def wait_ready(self) -> None:
        ranks = list(range(self.spec.size))
        name = f"{method_name(self.factory)}()"
        try:
            results = self._get([a.ready.remote() for a in self.actors], ranks, name)
        except WorkerError:
            self.shutdown()
            raise
        for rank, failure in zip(ranks, results):
            if failure is not None:
                self.shutdown()
                raise WorkerError(self.spec.name, rank, name, failure)

    def submit(self, method: Any, calls: Calls, collect: CollectFn) -> GroupFuture:
        import ray

        puts: dict[tuple, Any] = {}
        refs, ranks = [], []
        for rank, args, kwargs in calls:
            key = (tuple(map(id, args)), tuple((k, id(v)) for k, v in kwargs.items()))
            if key not in puts:  # each distinct share goes to the object store once
                puts[key] = ray.put((args, kwargs))
            refs.append(self.actors[rank].call.remote(method, [puts[key]]))
            ranks.append(rank)
        name = method_name(method)

        def is_done() -> bool:
            return len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) == len(refs)

        return GroupFuture(self.spec.name, name, ranks, lambda t: self._get(refs, ranks, name, t), collect, is_done)

    @property
    def actors(self) -> list[Any]:
        return self.gang.actors

    def info(self) -> list[dict[str, Any]]:
        import ray

        return [{"rank": r, "pid": i.pid, "CUDA_VISIBLE_DEVICES": i.visible_devices, "gpu_ids": list(i.gpus),
                 "node_id": i.node_id} for r, i in enumerate(ray.get([a.info.remote() for a in self.actors]))]

    def stats(self) -> list[dict[str, Any]]:
        import ray

        return [{"rank": r, "calls": s.calls, "bytes_in": s.bytes_in}
                for r, s in enumerate(ray.get([a.stats.remote() for a in self.actors]))]

    def shutdown(self) -> None:
        self.gang.stop()   # its actors; the unit's placement group is the runtime's


def pick_address() -> tuple[str, int]:
    """Run on a group's rank 0 node: its address and a port free there (reachable from the other nodes)."""
    import ray

    return ray.util.get_node_ip_address(), free_port("0.0.0.0")


class RayGroups(GroupsMode):
    """One actor per worker, in its unit's placement group (this module)."""

    name = "ray"
    spread = True
    driver = "Ray driver"
    where = "each worker a Ray actor on its role's devices"

    def connect(self, spec: RolesSpec) -> Any:
        return ensure_ray(spec)

    def placements(self, spec: RolesSpec) -> Any:
        from dualrun.backends.ray.cluster import Gang

        return Gang(spec.ray, spec.source)

    def devices(self, group: GroupSpec) -> str:
        return f"{group.gpus} GPU(s), one per worker" if group.gpus else "CPU"   # Ray gives each its GPU

    def workers(self, runtime: Any, spec: GroupSpec, factory: Callable[..., Any], args: tuple,
                kwargs: dict) -> Any:
        return RayWorkers(runtime, spec, factory, args, kwargs)

    def placement(self, spec: RolesSpec, group: GroupSpec, placements: Any) -> Any:
        return make_placement(spec, group, placements)


RAY_GROUPS = RayGroups()
