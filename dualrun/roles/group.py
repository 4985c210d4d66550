"""`WorkerGroup`: the workers of one role, and calls on them under the dispatch/execute/collect rules.

The group is the same object on both backends; only its workers differ: Ray actors placed on the role's
devices (`dualrun.roles.ray_backend`), or in-process instances (`LocalWorkers`), one per worker of the
role, so a program gets the same results with or without Ray.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

from dualrun.roles.context import RemoteFailure, WorkerContext, WorkerError, as_worker, call_safely, method_name
from dualrun.roles.dispatch import CollectFn, DispatchFn, plan_calls, resolve_collect
from dualrun.roles.spec import GroupSpec

Calls = list[tuple[int, tuple, dict]]


def bind(obj: Any, method: Any) -> Callable[..., Any]:
    """The callable a worker runs: `obj.<method>` for a name, `method(obj, ...)` for a function."""
    return getattr(obj, method) if isinstance(method, str) else functools.partial(method, obj)


class GroupFuture:
    """The pending result of one group call; `result()` collects it (raising a worker's failure)."""

    def __init__(self, group: str, method: str, ranks: Sequence[int], fetch: Callable[[float | None], list],
                 collect: CollectFn, is_done: Callable[[], bool] = lambda: True) -> None:
        self.group, self.method, self.ranks = group, method, list(ranks)
        self._fetch, self._collect, self._is_done = fetch, collect, is_done
        self._value: Any = None
        self._resolved = False

    def done(self) -> bool:
        return self._resolved or self._is_done()

    def result(self, timeout: float | None = None) -> Any:
        if not self._resolved:
            results = self._fetch(timeout)
            for rank, r in zip(self.ranks, results):
                if isinstance(r, RemoteFailure):
                    raise WorkerError(self.group, rank, self.method, r)
            self._value = self._collect(results)
            self._resolved = True
        return self._value


class LocalWorkers:
    """Workers of a group as instances in this process; calls run in rank order when submitted."""

    backend = "local"

    def __init__(self, spec: GroupSpec, factory: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        from dualrun.roles.rendezvous import free_port

        self.spec = spec
        self.objs: list[Any] = []
        self.calls = [0] * spec.size
        self.master = ("127.0.0.1", free_port())   # the group's rendezvous, as on Ray (WorkerContext)
        for rank in range(spec.size):
            with as_worker(self._context(rank)):
                obj = call_safely(factory, args, kwargs)
            if isinstance(obj, RemoteFailure):
                raise WorkerError(spec.name, rank, f"{method_name(factory)}()", obj)
            self.objs.append(obj)

    def submit(self, method: Any, calls: Calls, collect: CollectFn) -> GroupFuture:
        results = []
        for rank, args, kwargs in calls:
            self.calls[rank] += 1
            with as_worker(self._context(rank)):
                results.append(call_safely(bind(self.objs[rank], method), args, kwargs))
        return GroupFuture(self.spec.name, method_name(method), [c[0] for c in calls], lambda _t: results, collect)

    def _context(self, rank: int) -> WorkerContext:
        return WorkerContext(self.spec.name, rank, self.spec.size, "local", *self.master)

    def info(self) -> list[dict[str, Any]]:
        import os

        return [{"rank": r, "pid": os.getpid(), "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}
                for r in range(self.spec.size)]

    def stats(self) -> list[dict[str, Any]]:
        return [{"rank": r, "calls": c, "bytes_in": None} for r, c in enumerate(self.calls)]

    def shutdown(self) -> None:
        self.objs = []


class WorkerGroup:
    """The workers of one role (`group`): `size` of them, each built by `factory(*args, **kwargs)`.

    On Ray (`dualrun.init(backend='ray')` or `dualrun launch --backend ray`) each worker is an actor on the
    role's devices; otherwise an instance in this process. `run` blocks, `run_async` returns a GroupFuture.
    """

    def __init__(self, factory: Callable[..., Any], group: str, args: Sequence[Any] = (),
                 kwargs: dict[str, Any] | None = None, *, runtime: Any = None, _wait: bool = True) -> None:
        from dualrun.roles.runtime import get_runtime

        self.runtime = runtime or get_runtime()
        self.spec: GroupSpec = self.runtime.group_spec(group)
        self.factory = factory
        self.workers = self.runtime.start_workers(self.spec, factory, tuple(args), dict(kwargs or {}))
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
        ready = getattr(self.workers, "wait_ready", None)
        if ready is not None:
            ready()
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
