"""The Ray actor behind one worker of a role program (backends/ray/actor_groups.py places and drives it): its
context is set before the user's class is built, and it serves calls by name.

Payloads arrive *boxed* (`[ref]`), so each actor pulls only the share it was given and can report how many bytes it
received (`track_bytes`).
"""
from __future__ import annotations

import os
from typing import Any, Callable

from dualrun.contract import protocol
from dualrun.contract.protocol import ActorPlace, WorkerStats
from dualrun.role_programs.context import RemoteFailure, WorkerContext, call_safely, set_actor_context
from dualrun.role_programs.workers import bind


def _object_size(ref: Any) -> int:
    import ray

    try:
        info = ray.experimental.get_object_locations([ref]).get(ref) or {}
        return int(info.get("object_size") or 0)
    except Exception:  # noqa: BLE001 - an estimate for stats only
        return 0


class RoleActor:
    """The process of one worker: its context is set before the user's class is built."""

    def __init__(self, factory: Callable[..., Any], group: str, rank: int, size: int, env: dict[str, str],
                 args: tuple, kwargs: dict, track_bytes: bool) -> None:
        os.environ.update(env)
        os.environ[protocol.ROLES_MODE] = "local"  # groups made inside a worker are local to it
        set_actor_context(WorkerContext(group, rank, size, "ray", env.get("MASTER_ADDR"),
                                        int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else None))
        self.track_bytes = track_bytes
        self.calls = 0
        self.bytes_in = 0
        self.obj = call_safely(factory, args, kwargs)

    def ready(self) -> RemoteFailure | None:
        return self.obj if isinstance(self.obj, RemoteFailure) else None

    def call(self, method: Any, boxed: list) -> Any:
        import ray

        ref = boxed[0]
        args, kwargs = ray.get(ref)
        self.calls += 1
        if self.track_bytes:
            self.bytes_in += _object_size(ref)
        if isinstance(self.obj, RemoteFailure):
            return self.obj
        return call_safely(bind(self.obj, method), args, kwargs)

    def info(self) -> ActorPlace:
        import ray

        return ActorPlace(ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id(),
                          tuple(str(g) for g in ray.get_gpu_ids()), os.getpid(),
                          visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))

    def stats(self) -> WorkerStats:
        return WorkerStats(self.calls, self.bytes_in if self.track_bytes else None)
