"""How a role program starts under `dualrun launch --backend ray`: once, as the driver of the Ray job.

A *role program* is a single controller: its worker classes become actor groups placed by the config's roles.
`dualrun launch` recognises one (a `@dualrun.worker` / `@worker` class, a `dualrun.init(...)` or `WorkerGroup(...)`
call, a module-level `DUALRUN_ROLE_PROGRAM = True`, or a method plugin with `single_controller = True`) and
runs it in one process with `DUALRUN_ROLES_MODE=ray` and the groups in `DUALRUN_ROLES_SPEC`. Under torchrun
(or plain python) the same file runs in every process and its groups are local.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import time
from typing import Any

from dualrun.protocol import ROLES_MODE, ROLES_SPEC
from dualrun.roles.spec import groups_table, spec_from_config

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


def run_driver(cfg: Any, program: Any, dry_run: bool = False) -> Any:
    """Run the role program as the single driver; returns a JobResult (exit code of the driver)."""
    from dualrun.envspec import redact_value
    from dualrun.launchers.base import JobResult, RankResult, bootstrap_cmd, join_cmd

    spec = spec_from_config(cfg)
    cmd = bootstrap_cmd(program)
    run_id = f"dualrun-{os.getpid()}-{int(time.time())}"
    if dry_run:
        print(groups_table(spec))
        print(f"# dualrun dry run: backend=ray, role program run once as the driver; nothing was started\n"
              f"{ROLES_MODE}=ray {ROLES_SPEC}='{redact_value(ROLES_SPEC, spec.to_json())}' {join_cmd(cmd)}")
        return JobResult(0)
    print(f"dualrun: {groups_table(spec)}", file=sys.stderr, flush=True)
    start = time.monotonic()
    proc = subprocess.run(cmd, env=driver_env(cfg, run_id))
    wall = time.monotonic() - start
    code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
    msg = None if code == 0 else f"the role program's driver exited with code {proc.returncode}"
    print(f"dualrun: job {'succeeded' if code == 0 else f'failed (exit code {code})'} in {wall:.1f} s",
          file=sys.stderr, flush=True)
    return JobResult(code, [RankResult("driver", 0, code, msg)], wall, message=msg)
