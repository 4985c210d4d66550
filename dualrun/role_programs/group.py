"""`WorkerGroup`: the workers of one role, and calls on them under the dispatch/execute/collect rules.

The group is the same object on both backends; only its workers differ: Ray actors placed on the role's
devices (`dualrun.backends.ray.actor_groups`), or without Ray one child process per worker
(`dualrun.role_programs.child_workers`; a group of one worker: an instance in this process,
`dualrun.role_programs.workers.LocalWorkers`), so a program gets the same results, and its groups the same process
groups, with or without Ray.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from dualrun.role_programs.dispatch import CollectFn, DispatchFn, plan_calls, resolve_collect
from dualrun.role_programs.runtime import get_runtime
from dualrun.role_programs.spec import GroupSpec
from dualrun.role_programs.workers import GroupFuture, Workers


class WorkerGroup:
    """The workers of one role (`group`): `size` of them, each built by `factory(*args, **kwargs)`.

    On Ray (`dualrun.init(backend='ray')` or `dualrun launch --backend ray`) each worker is an actor on the
    role's devices; otherwise a child process per worker (one worker: an instance in this process). `run` blocks, `run_async` returns a GroupFuture.
    """

    def __init__(self, factory: Callable[..., Any], group: str, args: Sequence[Any] = (),
                 kwargs: dict[str, Any] | None = None, *, runtime: Any = None, _wait: bool = True) -> None:
        self.runtime = runtime or get_runtime()
        self.spec: GroupSpec = self.runtime.group_spec(group)
        self.factory = factory
        self.workers: Workers = self.runtime.start_workers(self.spec, factory, tuple(args), dict(kwargs or {}))
        self.runtime.track(self)
        if _wait:
            self.wait_ready()

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def size(self) -> int:
        return self.spec.size

    @property
    def backend(self) -> str:
        return self.workers.backend

    def wait_ready(self) -> "WorkerGroup":
        self.workers.wait_ready()
        return self

    def _method(self, method: Any) -> Any:
        if callable(method) and not isinstance(method, str):
            name = getattr(method, "__name__", None)
            if name and getattr(self.factory, name, None) is method:
                return name  # a method of the worker class: send its name, not the function
        return method

    def run_async(self, method: str | Callable[..., Any], *args: Any, dispatch: str | DispatchFn = "all",
                  execute: str = "all", collect: str | CollectFn = "none", **kwargs: Any) -> GroupFuture:
        """Call `method` on the group's workers; a future of the collected result."""
        calls = plan_calls(self.size, execute, dispatch, args, kwargs)
        return self.workers.submit(self._method(method), calls, resolve_collect(collect))

    def run(self, method: str | Callable[..., Any], *args: Any, dispatch: str | DispatchFn = "all",
            execute: str = "all", collect: str | CollectFn = "none", **kwargs: Any) -> Any:
        """Call `method` on the group's workers and return the collected result (a worker failure raises
        WorkerError naming its rank, with its traceback)."""
        return self.run_async(method, *args, dispatch=dispatch, execute=execute, collect=collect,
                              **kwargs).result()

    def info(self) -> list[dict[str, Any]]:
        """Per worker: rank, pid, CUDA_VISIBLE_DEVICES (and Ray's GPU ids on Ray)."""
        return self.workers.info()

    def stats(self) -> list[dict[str, Any]]:
        """Per worker: calls served and payload bytes received (Ray with track_bytes; None otherwise)."""
        return self.workers.stats()

    def shutdown(self) -> None:
        self.workers.shutdown()
        self.runtime.untrack(self)

    def __repr__(self) -> str:
        return f"WorkerGroup({self.name!r}, size={self.size}, backend={self.backend!r})"
