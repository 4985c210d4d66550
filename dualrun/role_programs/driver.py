"""Recognising a role program, and the env it starts with (the launcher is dualrun.launchers.role_program).

A *role program* is a single controller: its worker classes become actor groups placed by the config's roles.
`dualrun launch` recognises one (a `@dualrun.worker` / `@worker` class, a `dualrun.init(...)` or `WorkerGroup(...)`
call, a module-level `DUALRUN_ROLE_PROGRAM = True`, or a method plugin with `single_controller = True`) and
runs it once, in one process, with the groups in `DUALRUN_ROLES_SPEC`: `DUALRUN_ROLES_MODE=ray` (groups are
actors) on Ray, `local` (groups are child processes of the driver) under torchrun - the same single controller
as Ray Train's or ms-swift's driver, so each group is started once, whatever the primary role's size.
"""
from __future__ import annotations

import ast
import os
from typing import Any

from dualrun.contract.protocol import ROLES_MODE, ROLES_SPEC
from dualrun.role_programs.spec import spec_from_config

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


def roles_mode(cfg: Any) -> str:
    """The mode the backend runs a role program's groups in (`ray`, or `local` under torchrun): what
    `DUALRUN_ROLES_MODE` the driver gets."""
    return cfg.backend_kind.groups


def check_role_job(cfg: Any) -> None:
    """Layouts a role program cannot run: local groups are processes of this machine, so torchrun on several."""
    from dualrun.role_programs.modes import mode_of

    if not mode_of(roles_mode(cfg)).spread and cfg.num_machines > 1:
        from dualrun.contract.errors import ConfigError

        raise ConfigError(cfg.source, "num_machines", "1 for a role program under torchrun (it runs once; its "
                          "groups are processes of this machine)", cfg.num_machines,
                          hint="use --backend ray to place its groups on several machines")


def driver_env(cfg: Any, run_id: str) -> dict[str, str]:
    """The driver's env: ours, the plan's common env (DUALRUN_BACKEND, _METHOD, _SETTINGS, `env:`), the groups."""
    from dualrun.plan.processes import AUTO, make_plan

    env = dict(os.environ)
    env.update({k: (run_id if v == AUTO else v) for k, v in make_plan(cfg, environ=os.environ).env.items()})
    env[ROLES_MODE] = roles_mode(cfg)
    env[ROLES_SPEC] = spec_from_config(cfg).to_json()
    return env
