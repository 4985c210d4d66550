"""`@dualrun.worker(group=[...])` on a class, `@dualrun.function(group=..., dispatch=..., ...)` on its methods.

On the driver, constructing a worker class returns a `RoleProxy`: one `WorkerGroup` per group of the class
(actors on Ray, local processes otherwise), and its decorated methods become group calls. Inside a worker
the class is an ordinary class and its methods ordinary methods.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from dualrun.role_programs.context import in_worker
from dualrun.role_programs.dispatch import CollectFn, DispatchFn, check_execute, resolve_collect, resolve_dispatch
from dualrun.role_programs.group import WorkerGroup
from dualrun.role_programs.workers import GroupFuture

SPEC_ATTR = "__dualrun_function__"
WORKER_ATTR = "__dualrun_worker__"


@dataclass(frozen=True)
class FunctionSpec:
    name: str
    group: str | None
    dispatch: str | DispatchFn = "all"
    execute: str = "all"
    collect: str | CollectFn = "none"


@dataclass(frozen=True)
class WorkerSpec:
    groups: tuple[str, ...]
    methods: dict[str, FunctionSpec]


def function(fn: Callable[..., Any] | None = None, *, group: str | None = None,
             dispatch: str | DispatchFn = "all", execute: str = "all",
             collect: str | CollectFn = "none") -> Any:
    """Mark a method of a worker class as a group call. The rules are checked here, not at the first call."""
    resolve_dispatch(dispatch)
    resolve_collect(collect)
    check_execute(execute)

    def deco(f: Callable[..., Any]) -> Callable[..., Any]:
        setattr(f, SPEC_ATTR, FunctionSpec(f.__name__, group, dispatch, execute, collect))
        return f

    return deco(fn) if fn is not None else deco


def worker(cls: type | None = None, *, group: str | Sequence[str]) -> Any:
    """Make `cls` a worker class whose instances live in `group` (one group name or a list of them)."""
    groups = (group,) if isinstance(group, str) else tuple(group)
    if not groups or not all(isinstance(g, str) and g for g in groups):
        raise ValueError(f"@dualrun.worker(group=...): expected a group name or a list of them, got {group!r}")

    def deco(klass: type) -> type:
        methods: dict[str, FunctionSpec] = {}
        for base in reversed(klass.__mro__):
            for name, attr in vars(base).items():
                spec = getattr(attr, SPEC_ATTR, None)
                if spec is None:
                    continue
                if spec.group is None:
                    if len(groups) > 1:
                        raise ValueError(f"{klass.__name__}.{name}: @dualrun.function needs group=... (the class "
                                         f"lives in several groups: {list(groups)})")
                    spec = replace(spec, group=groups[0])
                if spec.group not in groups:
                    raise ValueError(f"{klass.__name__}.{name}: group {spec.group!r} is not one of the class's "
                                     f"groups {list(groups)}")
                methods[name] = replace(spec, name=name)
        setattr(klass, WORKER_ATTR, WorkerSpec(groups, methods))
        own_new = klass.__dict__.get("__new__")

        def __new__(c: type, *args: Any, **kwargs: Any) -> Any:
            if in_worker():  # inside a worker (or a local virtual worker): an ordinary instance
                if own_new is not None:
                    return own_new(c, *args, **kwargs)
                return super(klass, c).__new__(c)
            return RoleProxy(c, args, kwargs)

        klass.__new__ = staticmethod(__new__)  # type: ignore[assignment]
        return klass

    return deco(cls) if cls is not None else deco


class BoundGroupCall:
    """`proxy.method(...)` blocks and returns the collected result; `proxy.method.submit(...)` a future."""

    def __init__(self, group: WorkerGroup, spec: FunctionSpec) -> None:
        self.group, self.spec = group, spec
        functools.update_wrapper(self, getattr(group.factory, spec.name))

    def submit(self, *args: Any, **kwargs: Any) -> GroupFuture:
        s = self.spec
        return self.group.run_async(s.name, *args, dispatch=s.dispatch, execute=s.execute, collect=s.collect,
                                    **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.submit(*args, **kwargs).result()


class RoleProxy:
    """What constructing a worker class returns on the driver: its groups, and its decorated methods."""

    def __init__(self, cls: type, args: tuple, kwargs: dict) -> None:
        spec: WorkerSpec = getattr(cls, WORKER_ATTR)
        object.__setattr__(self, "_cls", cls)
        groups: dict[str, WorkerGroup] = {}
        try:
            for name in spec.groups:  # start every group's workers, then wait for all of them
                groups[name] = WorkerGroup(cls, name, args, kwargs, _wait=False)
            for g in groups.values():
                g.wait_ready()
        except BaseException:
            for g in groups.values():
                g.shutdown()
            raise
        object.__setattr__(self, "groups", groups)

    def __getattr__(self, name: str) -> Any:
        spec: WorkerSpec = getattr(self._cls, WORKER_ATTR)
        if name in spec.methods:
            method = spec.methods[name]
            return BoundGroupCall(self.groups[method.group], method)  # type: ignore[index]
        raise AttributeError(f"{self._cls.__name__}.{name}: on the driver a worker class offers only its "
                             f"@dualrun.function methods ({', '.join(spec.methods) or 'none'}); its state lives "
                             f"in the workers of {list(spec.groups)}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{self._cls.__name__}: set state inside a @dualrun.function method; on the driver "
                             "the object is a handle to its workers")

    def shutdown(self) -> None:
        for g in self.groups.values():
            g.shutdown()

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}: {g.size} {g.backend} worker(s)" for n, g in self.groups.items())
        return f"<{self._cls.__name__} proxy {{{inner}}}>"
