"""The workers of a group: the interface every backend's workers implement (`Workers`), what the backends share
(the call list, `bind`, `GroupFuture`) and `LocalWorkers`.

Why a module of its own: `WorkerGroup` (group.py) reaches the backends through the runtime, and the Ray backend
(ray_backend.py) builds on these pieces; here, below both, neither group.py nor ray_backend.py imports the other.
"""
from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from typing import Any, Callable, Sequence

from dualrun.role_programs.context import RemoteFailure, WorkerContext, WorkerError, as_worker, call_safely, method_name
from dualrun.role_programs.dispatch import CollectFn
from dualrun.role_programs.spec import GroupSpec

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


class Workers(ABC):
    """The workers of one group, whatever runs them: `WorkerGroup` (group.py) talks to this and nothing else.

    Implemented by `LocalWorkers` (one worker, in this process), `ProcessWorkers` (role_programs/child_workers.py: a
    child process per worker) and `RayWorkers` (backends/ray/actor_groups.py: an actor per worker)."""

    backend: str   # "local" or "ray": what `WorkerGroup.backend` reports

    def wait_ready(self) -> None:
        """Block until every worker's instance is built; WorkerError naming the first that failed (the group is
        stopped then). Workers built in this process are ready once constructed."""

    @abstractmethod
    def submit(self, method: Any, calls: Calls, collect: CollectFn) -> GroupFuture:
        """Send each call of `calls` to its worker; a future of the collected result."""

    @abstractmethod
    def info(self) -> list[dict[str, Any]]:
        """Per worker: rank, pid, CUDA_VISIBLE_DEVICES (and Ray's GPU ids on Ray)."""

    @abstractmethod
    def stats(self) -> list[dict[str, Any]]:
        """Per worker: calls served and payload bytes received (None where not tracked)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every worker (idempotent)."""


class LocalWorkers(Workers):
    """A one-worker group as an instance in this process (groups of more: role_programs/child_workers.py)."""

    backend = "local"

    def __init__(self, spec: GroupSpec, factory: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        from dualrun.light.ports import free_port

        self.spec = spec
        self.objs: list[Any] = []
        self.calls = [0] * spec.size
        self.master = ("127.0.0.1", free_port("0.0.0.0"))   # the group's rendezvous, as on Ray (WorkerContext)
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
