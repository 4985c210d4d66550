"""Run a validated job: pick the launcher, plan, (dry-)run, summarise. Shared by the CLI and `dualrun.launch`."""
from __future__ import annotations

import sys
from typing import TextIO

from dualrun.config.model import JobConfig
from dualrun.errors import ConfigError
from dualrun.launchers import JobResult, Program, launcher_class
from dualrun.plan import make_plan
from dualrun.plugin import MethodPlugin


def _accelerate_env(cfg: JobConfig) -> dict[str, str]:
    from dualrun.accelerate_env import accelerate_env

    try:
        return accelerate_env(cfg)
    except (ValueError, TypeError, KeyError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(cfg.source, "accelerate keys", "a config accelerate accepts", msg) from None


def run_job(cfg: JobConfig, program: Program, plugin: MethodPlugin, dry_run: bool = False,
            out: TextIO | None = None) -> JobResult:
    out = out or sys.stderr
    launcher = launcher_class(cfg.backend)(cfg, program, _accelerate_env(cfg), plugin=plugin)
    cluster = None if dry_run else launcher.cluster()
    plan = make_plan(cfg, cluster)
    if dry_run:
        print(plan.table(), file=sys.stdout)
        print(launcher.describe(plan), file=sys.stdout)
        return JobResult(0)
    print(f"dualrun: {plan.table()}", file=out, flush=True)
    try:
        result = launcher.launch(plan)
    finally:
        launcher.close()
    status = "succeeded" if result.ok else f"failed (exit code {result.exit_code})"
    print(f"dualrun: job {status} in {result.wall_time_s:.1f} s"
          + (f" after {result.restarts} restart(s)" if result.restarts else ""), file=out, flush=True)
    if result.message and not result.ok:
        print(f"dualrun: error: {result.message}", file=out, flush=True)
    return result
