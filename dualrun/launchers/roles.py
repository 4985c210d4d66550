"""The role-program launcher (`dualrun launch --backend ray` of a single-controller program, docs/roles.md).

A role program runs once, as the driver of the Ray job: its worker classes become actor groups placed by the
config's roles (dualrun.roles). So this launcher starts one local process, `python -m dualrun.rank.bootstrap ...`,
with `DUALRUN_ROLES_MODE=ray` and the groups in `DUALRUN_ROLES_SPEC`; the program itself joins Ray.
"""
from __future__ import annotations

import subprocess
import sys
import time

from dualrun.envspec import redact_value
from dualrun.launchers.base import JobResult, Launcher, Prepared, RankResult, bootstrap_cmd, join_cmd
from dualrun.plan import Plan
from dualrun.protocol import ROLES_MODE, ROLES_SPEC
from dualrun.roles.driver import driver_env
from dualrun.roles.spec import groups_table, spec_from_config


class RoleDriverLauncher(Launcher):
    name = "ray-roles"

    def prepare(self, plan: Plan | None = None) -> Prepared:
        """The driver's command and its whole env (ours, the plan's common env, the groups)."""
        import os

        return Prepared(plan, tuple(bootstrap_cmd(self.program)), driver_env(self.cfg, self.run_id), os.getcwd())

    def describe(self, prepared: Prepared) -> str:
        return (f"{groups_table(spec_from_config(self.cfg))}\n"
                "# dualrun dry run: backend=ray, role program run once as the driver; nothing was started\n"
                f"{ROLES_MODE}={prepared.env[ROLES_MODE]} "
                f"{ROLES_SPEC}='{redact_value(ROLES_SPEC, prepared.env[ROLES_SPEC])}' {join_cmd(prepared.argv)}")

    def run_attempt(self, prepared: Prepared, attempt: int) -> JobResult:
        """Run the driver to its end; the job's exit code is the driver's."""
        print(f"dualrun: {groups_table(spec_from_config(self.cfg))}", file=sys.stderr, flush=True)
        start = time.monotonic()
        proc = subprocess.run(list(prepared.argv), env=dict(prepared.env), cwd=prepared.cwd)
        wall = time.monotonic() - start
        code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
        msg = None if code == 0 else f"the role program's driver exited with code {proc.returncode}"
        print(f"dualrun: job {'succeeded' if code == 0 else f'failed (exit code {code})'} in {wall:.1f} s",
              file=sys.stderr, flush=True)
        return JobResult(code, [RankResult("driver", 0, code, msg)], wall, message=msg)

    def restart_cause(self, result: JobResult) -> str | None:
        return None   # the role program owns its groups' failures (WorkerError on the driver)
