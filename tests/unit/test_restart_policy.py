"""Launcher.launch's one restart policy, in milliseconds: an attempt's outcome is a value (result, restart cause,
dead servers); a set whose server died is replaced by a fresh one that avoids its endpoints; servers that never
started end the job; the budget is max_failures. The server set here is a real (in-memory) one on the sets' base: the
launchers' e2e tests (test_server_watch.py, test_restarts.py) run the same policy with real servers."""
from __future__ import annotations

from dualrun.config import build_config
from dualrun.contract.errors import LaunchError
from dualrun.launchers.launcher import JobResult, Launcher, Outcome, Prepared, Program
from dualrun.servers.serverset import ServerDeath, ServerSet, ServerSetBase


class _Set(ServerSetBase):
    """Servers that bind `host:<n>` endpoints (never one in `avoid`), or fail to start."""

    def __init__(self, plan, avoid: frozenset[str], fail: bool) -> None:
        super().__init__(plan)
        self.avoid, self.fail, self.stops = avoid, fail, []
        self.endpoint = next(f"h:{n}" for n in range(100) if f"h:{n}" not in avoid)

    def start(self) -> dict[str, str]:
        if self.fail:
            raise LaunchError("teacher server 0 did not become healthy")
        self.addresses = {"teacher": self.endpoint}
        return self.addresses

    def wiring_env(self) -> dict[str, str]:
        return {}

    def used(self) -> frozenset[str]:
        return frozenset({self.endpoint})

    def _watch(self) -> None:
        pass

    def _stop(self, grace_s: float) -> None:
        self.stops.append(grace_s)


class _Launcher(Launcher):
    """Each attempt's outcome comes from `script`: "ok", "rank" (a rank failed) or "server" (a server died)."""

    def __init__(self, script: list[str], max_failures: int, fail_start: tuple[int, ...] = ()) -> None:
        super().__init__(build_config({"max_failures": max_failures}, "t.yaml"), Program("t.py"))
        self.script, self.fail_start, self.sets, self.attempts = script, fail_start, [], []

    def prepare(self, plan=None) -> Prepared:
        return Prepared(None, (), {}, ".")

    def describe(self, prepared: Prepared) -> str:
        return ""

    def server_set(self, plan, attempt: int, avoid: frozenset[str]) -> ServerSet:
        self.sets.append(_Set(_Plan(), avoid, attempt in self.fail_start))
        return self.sets[-1]

    def start_servers(self, servers, plan):
        return super().start_servers(servers, _Plan())

    def run_attempt(self, prepared: Prepared, attempt: int, servers) -> Outcome:
        self.attempts.append(servers)
        what = self.script[attempt]
        if what == "ok":
            return Outcome(JobResult(0))
        if what == "rank":
            return Outcome(JobResult(1, message="train rank 0 failed"), "train rank 0 failed; restarting the job")
        death = ServerDeath(0, "teacher server 0", "teacher server 0 exited with code -9", "teacher server 0 died")
        return Outcome(JobResult(1, message=str(death)), f"{death.one_line()}; restarting the job", (death,))


class _Plan:
    external: dict[str, str] = {}


def test_a_dead_server_gets_the_next_attempt_a_fresh_set_on_fresh_endpoints():
    launcher = _Launcher(["server", "rank", "ok"], max_failures=2)
    result = launcher.launch(launcher.prepare())
    first, second = launcher.sets
    assert result.ok and result.restarts == 2
    assert launcher.attempts == [first, second, second]   # a rank failure keeps the servers
    assert second.endpoint != first.endpoint and first.endpoint in second.avoid
    assert first.stops and second.stops and first.stopping and second.stopping   # every set stopped


def test_the_budget_ends_the_job_with_the_last_attempts_result():
    launcher = _Launcher(["server", "server"], max_failures=1)
    result = launcher.launch(launcher.prepare())
    assert result.exit_code == 1 and result.restarts == 1 and result.message == "teacher server 0 exited with code -9"
    assert len(launcher.sets) == 2 and all(s.stopping for s in launcher.sets)


def test_servers_that_never_start_end_the_job_without_a_restart():
    launcher = _Launcher(["server", "ok"], max_failures=3, fail_start=(1,))
    result = launcher.launch(launcher.prepare())
    assert result.exit_code == 1 and result.message == "teacher server 0 did not become healthy"
    assert result.restarts == 1 and len(launcher.attempts) == 1


def test_a_stop_slower_than_its_bound_is_said_part_by_part():
    from dualrun.launchers.launcher import SLOW_STOP_S

    assert JobResult(1, stopping={"the ranks": 1.0, "the servers": SLOW_STOP_S - 1.0}).stop_line() is None
    assert JobResult(1).stop_line() is None
    assert (JobResult(1, stopping={"the ranks": 0.4, "the servers": 9.6}).stop_line()
            == "stopping took 10.0 s (the ranks 0.4 s, the servers 9.6 s)")
    assert (JobResult(1, stopping={"the ranks": 3.2, "the servers": 0.01}).stop_line()
            == "stopping took 3.2 s (the ranks 3.2 s)")   # a part that took no time is not named


def test_the_job_end_says_how_long_its_servers_took_to_stop():
    import time

    class _SlowSet(_Set):
        def _stop(self, grace_s: float) -> None:
            time.sleep(0.2)
            super()._stop(grace_s)

    class _SlowLauncher(_Launcher):
        def server_set(self, plan, attempt: int, avoid: frozenset[str]) -> ServerSet:
            self.sets.append(_SlowSet(_Plan(), avoid, False))
            return self.sets[-1]

    launcher = _SlowLauncher(["ok"], max_failures=0)
    result = launcher.launch(launcher.prepare())
    assert result.ok and list(result.stopping) == ["the servers"] and 0.2 <= result.stopping["the servers"] < 5
