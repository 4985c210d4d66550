"""The role-program launcher (`dualrun launch` of a single-controller program, docs/roles.md), both backends.

A role program runs once, as the driver: its worker classes become groups placed by the config's roles
(dualrun.role_programs) - Ray actors on `--backend ray`, child processes of the driver under `--backend torchrun` - so
each group is started once, as in Ray Train or ms-swift's Ray helper. This launcher starts one local process,
`python -m dualrun.rank.bootstrap ...`, with `DUALRUN_ROLES_MODE` (`ray` / `local`) and the groups in
`DUALRUN_ROLES_SPEC`; the program itself joins Ray or spawns its local workers.
"""
from __future__ import annotations

import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

from dualrun.contract.redact import redact_argv, redact_value
from dualrun.launchers.launcher import JobResult, Launcher, Outcome, Prepared, RankResult, bootstrap_cmd, join_cmd
from dualrun.plan.processes import Plan
from dualrun.contract.protocol import ROLES_MODE, ROLES_SPEC
from dualrun.role_programs.driver import driver_env, roles_mode
from dualrun.role_programs.modes import groups_table
from dualrun.role_programs.spec import spec_from_config

if TYPE_CHECKING:
    from dualrun.config.model import JobConfig


class RoleDriverLauncher(Launcher):
    """Built from the config itself: a role program has no plan of ranks (its groups are placed as it runs)."""

    name = "roles"

    def __init__(self, cfg: "JobConfig", *args: Any, **kwargs: Any) -> None:
        super().__init__(cfg, *args, **kwargs)
        self.cfg = cfg

    def prepare(self, plan: Plan | None = None) -> Prepared:
        """The driver's command and its whole env (ours, the plan's common env, the groups)."""
        import os

        return Prepared(plan, tuple(bootstrap_cmd(self.program)), driver_env(self.cfg, self.run_id), os.getcwd())

    def table(self) -> str:
        """What runs: the driver and its groups (the first line of a launch; `dualrun plan` prints the same)."""
        return groups_table(spec_from_config(self.cfg), roles_mode(self.cfg))

    def describe(self, prepared: Prepared) -> str:
        return (f"{self.table()}\n"
                f"# dualrun dry run: backend={self.cfg.backend}, role program run once as the driver "
                f"({prepared.env[ROLES_MODE]} groups); nothing was started\n"
                f"{ROLES_MODE}={prepared.env[ROLES_MODE]} "
                f"{ROLES_SPEC}='{redact_value(ROLES_SPEC, prepared.env[ROLES_SPEC])}' {join_cmd(redact_argv(prepared.argv))}")

    def run_attempt(self, prepared: Prepared, attempt: int, servers: Any = None) -> Outcome:
        """Run the driver to its end; the job's exit code is the driver's. No restart: the role program owns its
        groups' failures (WorkerError on the driver)."""
        print(f"dualrun: {self.table()}", file=sys.stderr, flush=True)
        start = time.monotonic()
        proc = subprocess.run(list(prepared.argv), env=dict(prepared.env), cwd=prepared.cwd)
        wall = time.monotonic() - start
        code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
        msg = None if code == 0 else f"the role program's driver exited with code {proc.returncode}"
        print(f"dualrun: job {'succeeded' if code == 0 else f'failed (exit code {code})'} in {wall:.1f} s",
              file=sys.stderr, flush=True)
        return Outcome(JobResult(code, [RankResult("driver", 0, code, msg)], wall, message=msg))
