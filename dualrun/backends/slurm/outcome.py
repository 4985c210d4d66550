"""What an ended ranks' step came to: which rank failed first (srun's error lines, in the order it reported them,
and the error file the rank's bootstrap left), one line naming it, and whether the job restarts."""
from __future__ import annotations

import json
import os

from dualrun.backends.slurm.step_process import Step
from dualrun.backends.slurm.steps import failed_tasks
from dualrun.contract.errors import killed_by
from dualrun.launchers.launcher import JobResult, Outcome, RankResult, failed_job
from dualrun.plan.processes import Plan


def error_of(error_dir: str, rank: int) -> str | None:
    """The last line of the exception rank `rank` recorded (rank/bootstrap.py, torch's error-file format)."""
    path = os.path.join(error_dir, f"rank{rank}.json")
    try:
        with open(path) as f:
            return str(json.load(f)["message"]["message"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def ranks_outcome(step: Step, plan: Plan | None, error_dir: str, wall_s: float, may_restart: bool) -> Outcome:
    """The step's result: every rank's, and on failure the first rank that failed by itself named."""
    assert plan is not None
    unit = plan.workers[0].unit
    code = step.poll()
    if code == 0:
        return Outcome(JobResult(0, [RankResult(p.label, p.rank, 0) for p in plan.workers], wall_s))
    reported = failed_tasks(step.errors)
    ranks = [RankResult(f"{unit} rank {t}", t, c, error_of(error_dir, t), end=float(i))
             for i, (t, c) in enumerate(reported)]
    own = [r for r in ranks if r.exit_code > 0]   # the ones srun killed after it (`Killed`) are not the cause
    fallback = ranks[0] if ranks else RankResult(f"{unit} ranks' srun step", -1, code if code is not None else 1,
                                                  killed_by(code) or "srun named no task")
    result = failed_job(ranks, own, fallback, wall_s)
    restart = f"{result.message}; restarting the job" if may_restart else None
    return Outcome(result, restart)
