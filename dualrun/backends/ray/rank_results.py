"""What the Ray driver makes of its ranks' results: the one-line failure and the return values.

Pure functions of what the rank actors returned (no Ray calls), so the Ray launcher keeps only the orchestration.
"""
from __future__ import annotations

import pickle
from typing import Any, Sequence

from dualrun.launchers.launcher import JobResult, RankResult, failed_job
from dualrun.contract.protocol import RankExit


def failure(ranks: Sequence[Any], first: int, stop_time: float | None) -> JobResult:
    """One line naming the rank that failed first (before the driver stopped the others) and its error's last line.

    `ranks` have `.proc` (the planned process) and `.result` (the actor's RankExit, or None)."""
    stop = stop_time or float("inf")
    results = rank_results(ranks)
    own = [res for r, res in zip(ranks, results) if r.result and r.result.exit_code != 0 and r.result.end <= stop]
    return failed_job(results, own, results[first])


def rank_results(ranks: Sequence[Any]) -> list[RankResult]:
    """Every rank's exit code and error (-15: stopped before it reported, e.g. its actor was killed)."""
    return [RankResult(r.proc.label, r.proc.rank, r.result.exit_code if r.result else -15,
                       r.result.error if r.result else None, end=r.result.end if r.result else None) for r in ranks]


def value(result: RankExit | None) -> Any:
    """Python API: a rank's return value, pickled on its node and returned by its actor."""
    data = result.value if result is not None else None
    return pickle.loads(data) if data is not None else None


def first_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return lines[0][:200] if lines else type(e).__name__
