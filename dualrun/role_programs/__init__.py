"""Role-splitting API: worker classes whose methods run on a role's workers (Ray actors, local processes).

    @dualrun.worker(group="sampler")
    class Sampler:
        @dualrun.function(dispatch="slice", collect="flatten")
        def generate(self, prompts): ...

See docs/roles.md. Public names are re-exported lazily from `dualrun`.
"""
from __future__ import annotations

from typing import Any

# name -> its module; imported on first use (PEP 562), so the launch path's `dualrun.role_programs.driver` (is this
# a role program?) does not import the whole API (~15 ms of every launch)
_WHERE = {
    "UnknownGroupError": "context", "WorkerContext": "context", "WorkerError": "context", "current": "context",
    "RoleProxy": "decorators", "function": "decorators", "worker": "decorators",
    "COLLECT": "dispatch", "DISPATCH": "dispatch", "register_collect": "dispatch", "register_dispatch": "dispatch",
    "WorkerGroup": "group", "get_runtime": "runtime", "init": "runtime", "shutdown": "runtime",
    "GroupFuture": "workers",
}

__all__ = ["COLLECT", "DISPATCH", "GroupFuture", "RoleProxy", "UnknownGroupError", "WorkerContext", "WorkerError",
           "WorkerGroup", "current", "function", "get_runtime", "init", "register_collect", "register_dispatch",
           "shutdown", "worker"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'dualrun.role_programs' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"dualrun.role_programs.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
