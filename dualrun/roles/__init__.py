"""Role-splitting API: worker classes whose methods run on a role's workers (Ray actors, local processes).

    @dualrun.worker(group="sampler")
    class Sampler:
        @dualrun.function(dispatch="slice", collect="flatten")
        def generate(self, prompts): ...

See docs/roles.md. Public names are re-exported lazily from `dualrun`.
"""
from __future__ import annotations

from dualrun.roles.context import UnknownGroupError, WorkerContext, WorkerError, current
from dualrun.roles.decorators import RoleProxy, function, worker
from dualrun.roles.dispatch import COLLECT, DISPATCH, register_collect, register_dispatch
from dualrun.roles.group import WorkerGroup
from dualrun.roles.runtime import get_runtime, init, shutdown
from dualrun.roles.workers import GroupFuture

__all__ = ["COLLECT", "DISPATCH", "GroupFuture", "RoleProxy", "UnknownGroupError", "WorkerContext", "WorkerError",
           "WorkerGroup", "current", "function", "get_runtime", "init", "register_collect", "register_dispatch",
           "shutdown", "worker"]
