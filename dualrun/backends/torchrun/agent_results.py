"""What an ended torchrun agent came to, as one line: the rank that failed first by itself, a server whose death
ended the attempt, or a machine the rendezvous never saw.

Why apart from the launcher: these read torch's errors (ChildFailedError's failures, a DistError) and the
watches' findings into a `JobResult`; the launcher only runs the agent."""
from __future__ import annotations

import time
from typing import Any

from dualrun.backends.torchrun.machine_watch import MachineWatch
from dualrun.launchers.launcher import JobResult, RankResult, failed_job
from dualrun.servers.serverset import ServerSet


def not_met(e: BaseException, watch: MachineWatch, waited_s: float) -> str | None:
    """The line for an agent whose rendezvous gave up (`e`, torch's store error) before every machine came: the
    machines machine 0 never saw, or, on machine K, machine 0 whose store it never reached; None for any other
    error."""
    from torch.distributed import DistError

    if not isinstance(e, DistError):
        return None
    if watch.machine == 0:
        missing = watch.unjoined()
        return watch.unjoined_line(missing) if missing else None
    if watch.reached:
        return None
    return watch.absent_line(waited_s)


def server_died(servers: ServerSet, start: float) -> JobResult:
    """The job ended because a server died: name it, its exit code and its log's last lines."""
    return JobResult(1, wall_time_s=time.monotonic() - start, message=str(servers.failure))


def _text(message) -> str:
    if isinstance(message, dict):
        inner = message.get("message", message)
        if isinstance(inner, dict):
            return str(inner.get("message", ""))
        return str(inner)
    return str(message or "")


def first_failure(e, wall: float, unit: str = "train") -> JobResult:
    """One line naming the first rank that failed by itself (exit code > 0, not one torchrun terminated
    afterwards) and the last line of its error."""
    ranks = {r: RankResult(f"{unit} rank {r}", r, f.exitcode, _text(f.message), end=f.timestamp)
             for r, f in sorted(e.failures.items())}
    own = [ranks[r] for r, f in e.failures.items() if f.exitcode is not None and f.exitcode > 0]
    return failed_job(list(ranks.values()), own, ranks[e.get_first_failure()[0]], wall)
