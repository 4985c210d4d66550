"""Recognising a role program, and the env it starts with (the launcher is dualrun.launchers.roles).

A *role program* is a single controller: its worker classes become actor groups placed by the config's roles.
`dualrun launch` recognises one (a `@dualrun.worker` / `@worker` class, a `dualrun.init(...)` or `WorkerGroup(...)`
call, a module-level `DUALRUN_ROLE_PROGRAM = True`, or a method plugin with `single_controller = True`) and
runs it in one process with `DUALRUN_ROLES_MODE=ray` and the groups in `DUALRUN_ROLES_SPEC`. Under torchrun
(or plain python) the same file runs in every process and its groups are local.
"""
from __future__ import annotations

import ast
import os
from typing import Any

from dualrun.protocol import ROLES_MODE, ROLES_SPEC
from dualrun.roles.spec import spec_from_config

_CALLS = {"init", "WorkerGroup"}


def _is_role_decorator(node: ast.expr) -> bool:
    target = node.func if isinstance(node, ast.Call) else node
    if isinstance(target, ast.Attribute):
        return target.attr == "worker" and isinstance(target.value, ast.Name) and target.value.id in (
            "dualrun", "roles")
    return isinstance(target, ast.Name) and target.id == "worker"


def is_role_program(path: str) -> bool:
    """A cheap static look at the script (never imports or runs it)."""
    try:
        if os.path.getsize(path) > 8 * 1024 * 1024:   # a script, not data: not worth parsing here
            return False
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError, RecursionError, MemoryError):
        return False   # not readable or too deep for the parser: not a role program (python reports the rest)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any(_is_role_decorator(d) for d in node.decorator_list):
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _CALLS \
                and isinstance(node.func.value, ast.Name) and node.func.value.id in ("dualrun", "roles"):
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "DUALRUN_ROLE_PROGRAM"
                                                for t in node.targets):
            return isinstance(node.value, ast.Constant) and bool(node.value.value)
    return False


def is_role_job(program: Any, plugin: Any) -> bool:
    """Is `program` a role program (single controller), by its plugin or by its source?"""
    if getattr(program, "call_file", None):
        return False
    if getattr(plugin, "single_controller", False):
        return True
    return not program.module and is_role_program(program.target)


def local_config(cfg: Any) -> Any:
    """torchrun: a role program runs in the first role's processes with every group in-process, so the other
    roles are not separate servers; the groups travel in `DUALRUN_ROLES_SPEC`."""
    from dataclasses import replace

    from dualrun.config.model import frozen_map

    env = {**cfg.env, ROLES_SPEC: spec_from_config(cfg).to_json(), ROLES_MODE: "local"}
    return replace(cfg, roles=(cfg.primary,), colocate_groups=(), env=frozen_map(env))


def driver_env(cfg: Any, run_id: str) -> dict[str, str]:
    """The driver's env: ours, the plan's common env (DUALRUN_BACKEND, _METHOD, _SETTINGS, `env:`), the groups."""
    from dualrun.plan import AUTO, make_plan

    env = dict(os.environ)
    env.update({k: (run_id if v == AUTO else v) for k, v in make_plan(cfg).env.items()})
    env[ROLES_MODE] = "ray"
    env[ROLES_SPEC] = spec_from_config(cfg).to_json()
    return env
