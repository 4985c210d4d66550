"""The Ray driver's wait on one attempt's ranks: their exits, their output, the servers' deaths and the shutdown
deadline, each handled by its own method.

Why a class of its own: the four concerns share one loop (one `ray.wait` over every rank's pending calls) but nothing
else; the launcher (actor_launcher.py) keeps placement, start and teardown. The first failure - a rank that exits
non-zero, a dead actor, or a server's death event from the job's server set - stops every rank and starts a shutdown
deadline (`SHUTDOWN_S`) after which the wait gives up on ranks that never reported.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from dualrun.launchers.launcher import JobResult, RankResult
from dualrun.backends.ray.rank_results import failure, first_line, rank_results, value
from dualrun.plan.processes import Process
from dualrun.contract.protocol import ActorPlace, RankExit
from dualrun.servers.serverset import ServerDeath, ServerSet

SHUTDOWN_S = 8.0        # stop + drain budget (a driver signal must end the job within 10 s)
POLL_S = 1.0            # the longest wait between two looks at the signal flag
SERVER_POLL_S = 0.25    # ... and at the servers' death events, when the job has servers
SERVER_SETTLE_S = 0.5   # ranks failed: how long a server's death may take to arrive (then it is the cause)


@dataclass
class Rank:
    """One rank of the attempt: its planned process, its actor, where it landed, its env and its exit."""

    proc: Process
    actor: Any
    info: ActorPlace | None = None
    env: dict[str, str] = field(default_factory=dict)
    result: RankExit | None = None


class RankWatch:
    """One attempt's wait (`run`) and what it came to (`result`, `server_failure`)."""

    def __init__(self, ranks: list[Rank], servers: ServerSet | None, stop_all: Callable[[], None],
                 check_signal: Callable[[], None]) -> None:
        self.ranks, self.servers, self.stop_all, self.check_signal = ranks, servers, stop_all, check_signal
        self.pending: dict[Any, tuple[str, int]] = {}   # ref -> ("exit" | "out", rank index)
        self.failed: list[int] = []                      # ranks that failed, first first
        self.deadline: float | None = None               # set once the ranks are being stopped
        self.server_failure: ServerDeath | None = None   # the server whose death ended the attempt
        self.poll_s = SERVER_POLL_S if servers is not None and servers.plan.servers else POLL_S

    def run(self) -> "RankWatch":
        import ray

        for i, r in enumerate(self.ranks):
            self.pending[r.actor.wait.remote()] = ("exit", i)
            self.pending[r.actor.lines.remote()] = ("out", i)
        while self.pending:
            ready, _ = ray.wait(list(self.pending), num_returns=1, timeout=self._timeout())
            if self.deadline is None:
                self.check_signal()
            self._server_deaths()
            if self.deadline is not None and time.monotonic() >= self.deadline and not ready:
                break
            for ref in ready:
                kind, i = self.pending.pop(ref)
                if kind == "out":
                    self._output(ref, i)
                else:
                    self._exit(ref, i)
        if self.failed and self.server_failure is None and self.servers is not None:
            # did the ranks fail because a server died?
            self.server_failure = self.servers.next_death(SERVER_SETTLE_S)
        return self

    def _timeout(self) -> float:
        if self.deadline is None:
            return self.poll_s
        return max(0.0, min(self.poll_s, self.deadline - time.monotonic()))

    def _shut_down(self) -> None:
        """The first failure: stop every rank (without waiting) and give them SHUTDOWN_S to report."""
        if self.deadline is None:
            self.stop_all()
            self.deadline = time.monotonic() + SHUTDOWN_S

    def _server_deaths(self) -> None:
        """Each death event of the job's servers; the first ends the attempt."""
        while self.servers is not None:
            death = self.servers.next_death()
            if death is None:
                return
            if self.server_failure is None:
                self.server_failure = death
            self._shut_down()

    def _output(self, ref: Any, i: int) -> None:
        """A batch of rank `i`'s output lines: printed, and the next long-poll sent (None: its output ended)."""
        import ray
        from ray.exceptions import RayActorError

        r = self.ranks[i]
        try:
            batch = ray.get(ref)
        except RayActorError:
            return
        if batch is not None:
            print_lines(r, batch)
            self.pending[r.actor.lines.remote()] = ("out", i)

    def _exit(self, ref: Any, i: int) -> None:
        """Rank `i` ended (or its actor died): the first that failed stops the others."""
        import ray
        from ray.exceptions import RayActorError

        r = self.ranks[i]
        try:
            r.result = ray.get(ref)
        except RayActorError as e:
            where = f" on node {r.info.ip}" if r.info else ""   # a lost node: the machine named
            r.result = RankExit(1, time.time(), f"its Ray actor{where} died ({first_line(e)})")
        if r.result.exit_code != 0 and not self.failed:
            self.failed.append(i)
            self.stop_all()
            self.deadline = time.monotonic() + SHUTDOWN_S

    def result(self, stop_time: float | None) -> JobResult:
        """The attempt's result: the dead server, else every rank's success, else the rank that failed first."""
        if self.server_failure is not None:
            return JobResult(1, rank_results(self.ranks), message=str(self.server_failure))
        if not self.failed:
            return JobResult(0, [RankResult(r.proc.label, r.proc.rank, 0, result=value(r.result)) for r in self.ranks])
        return failure(self.ranks, self.failed[0], stop_time)


def print_lines(r: Rank, batch: list[tuple[int, str]]) -> None:
    """A rank's lines on the driver's stdout / stderr (as the rank wrote them), each `[label] `-prefixed."""
    prefix = f"[{r.proc.label}] "
    out = [prefix + t for s, t in batch if s == 1]
    err = [prefix + t for s, t in batch if s != 1]
    if out:
        sys.stdout.write("\n".join(out) + "\n")
        sys.stdout.flush()
    if err:
        sys.stderr.write("\n".join(err) + "\n")
        sys.stderr.flush()
