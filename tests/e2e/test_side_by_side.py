"""Servers start beside the trainers (Launcher.start_servers): the policy in milliseconds on an in-memory set, then
real jobs on both backends: the ranks run while a slow server loads and wait for it where they first connect; a
server that never answers ends the job within its health_timeout_s, named, with no rank, engine, actor or placement
group left."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dualrun.config import build_config
from dualrun.contract.errors import LaunchError
from dualrun.contract.protocol import SERVERS_STARTING
from dualrun.launchers.launcher import JobResult, Launcher, Outcome, Prepared, Program
from dualrun.servers.serverset import ServerSetBase
from helpers import ASSETS, eventually, pids_matching
from ray_helpers import ray_env


class _Serving:
    health_timeout_s = 3.0


class _Server:
    serving = _Serving()


class _Plan:
    external: dict[str, str] = {}
    servers = [_Server()]


class _Beside(ServerSetBase):
    """A set that hands out its address first and starts in `start_s`, or fails there."""

    def __init__(self, fail: bool, start_s: float = 0.3) -> None:
        super().__init__(_Plan())
        self.fail, self.start_s, self.watched_at, self.started_at = fail, start_s, None, None

    def reserve(self):
        self.side_by_side()
        self.addresses = {"teacher": "127.0.0.1:20001"}
        return self.addresses

    def start(self):
        time.sleep(self.start_s)
        if self.fail:
            raise LaunchError("teacher server 0 did not become healthy within 3 s")
        self.started_at = time.monotonic()
        return self.addresses

    def wiring_env(self):
        return {"DUALRUN_TEACHER_ADDRESS": self.addresses["teacher"], **self.starting_env()}

    def used(self):
        return frozenset()

    def _watch(self):
        self.watched_at = time.monotonic()

    def _stop(self, grace_s):
        pass


class _Launcher(Launcher):
    """Each attempt: the ranks' env, then the set's death events for `run_s` (as the backends' attempts watch them)."""

    def __init__(self, fail: bool, max_failures: int = 2, run_s: float = 2.0) -> None:
        super().__init__(build_config({"max_failures": max_failures}, "t.yaml"), Program("t.py"))
        self.fail, self.run_s, self.sets, self.envs = fail, run_s, [], []

    def prepare(self, plan=None):
        return Prepared(None, (), {}, ".")

    def describe(self, prepared):
        return ""

    def server_set(self, plan, attempt, avoid):
        self.sets.append(_Beside(self.fail))
        return self.sets[-1]

    def start_servers(self, servers, plan):
        return super().start_servers(servers, _Plan())

    def run_attempt(self, prepared, attempt, servers):
        self.envs.append(servers.wiring_env())
        servers.watch()
        death = servers.next_death(timeout=self.run_s)
        if death is None:
            return Outcome(JobResult(0))
        return Outcome(JobResult(1, message=str(death)), f"{death.one_line()}; restarting the job", (death,))


def test_a_server_that_never_answers_ends_the_job_named_and_is_never_restarted():
    launcher = _Launcher(fail=True, max_failures=2)
    t0 = time.monotonic()
    result = launcher.launch(launcher.prepare())
    assert result.exit_code == 1 and result.message == "teacher server 0 did not become healthy within 3 s"
    assert result.restarts == 0 and len(launcher.sets) == 1 and launcher.sets[0].stopping
    assert time.monotonic() - t0 < 1.5   # the attempt ended at the failure, not at its own end
    assert launcher.envs[0][SERVERS_STARTING]   # the ranks ran beside the start, told to wait


def test_ranks_that_end_before_a_server_fails_to_start_still_fail_the_job():
    """A script that never uses its server ends first: the job's result waits for the start, which failed."""
    launcher = _Launcher(fail=True, run_s=0.0)
    result = launcher.launch(launcher.prepare())
    assert result.exit_code == 1 and result.message == "teacher server 0 did not become healthy within 3 s"
    assert result.restarts == 0 and launcher.sets[0].stopping


def test_the_ranks_start_before_the_servers_answer_and_the_watch_begins_once_they_do():
    launcher = _Launcher(fail=False, run_s=1.0)
    result = launcher.launch(launcher.prepare())
    (servers,) = launcher.sets
    assert result.ok and servers.stopping
    assert SERVERS_STARTING in launcher.envs[0]   # the attempt began while the set was starting
    assert servers.watched_at is not None and servers.watched_at >= servers.started_at
    assert servers.starting_env() == {}   # once started, a rank (a later attempt) waits for nothing


# -- real jobs ---------------------------------------------------------------------------------------------------
STEPS = 2


def _run(tmp_path: Path, tiny: Path, backend: str, cluster, teacher: str) -> tuple[subprocess.Popen, float]:
    (tmp_path / "job.yaml").write_text(
        f"use_cpu: true\nmethod: gkd\nmax_failures: 1\nroles:\n  train: {{gpus: 2}}\n"
        f"  teacher: {{gpus: 1, model: {tiny / 'teacher'}, top_k: 5, {teacher}}}\n")
    (tmp_path / "out").mkdir()
    env = dict(os.environ, **ray_env(RAY_ADDRESS=cluster.address if backend == "ray" else ""))
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "dualrun", "launch", "--backend", backend, "--config_file",
                             "job.yaml", str(ASSETS / "uses_teacher.py"), str(tmp_path / "out"), str(STEPS), "none"],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=(tmp_path / "stderr.txt").open("w"), text=True)
    return proc, t0


@pytest.fixture
def cluster(ray_cluster_if_ray):
    return ray_cluster_if_ray


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["torchrun", "ray"])
def test_the_trainers_run_while_a_slow_server_loads_and_wait_for_it_where_they_first_use_it(tmp_path, module_tiny,
                                                                                            cluster, backend):
    proc, _ = _run(tmp_path, module_tiny, backend, cluster, "health_timeout_s: 90, server_args: [--startup-delay, 8]")
    assert proc.wait(timeout=240) == 0, (tmp_path / "stderr.txt").read_text()[-3000:]
    err = (tmp_path / "stderr.txt").read_text()
    starting, waiting = err.index("teacher: server starting at"), err.index("dualrun: waiting for the teacher server")
    healthy = err.index("teacher: server healthy at")
    assert starting < waiting < healthy, err[-3000:]   # a rank ran and reached its first use before the server answered
    assert "(started in " in err[healthy:].splitlines()[0]
    assert sorted(p.name for p in (tmp_path / "out").glob("step_*")) == [f"step_{r}_{s}" for r in (0, 1)
                                                                         for s in range(STEPS)]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["torchrun", "ray"])
def test_a_server_that_never_answers_ends_the_job_within_its_bound_with_no_rank_left(tmp_path, module_tiny, cluster,
                                                                                    backend):
    """max_failures: 1 is not spent on it (nothing to restart): the job ends once, named, and its ranks, which were
    already running and waiting for the server, are stopped with it."""
    proc, t0 = _run(tmp_path, module_tiny, backend, cluster, "health_timeout_s: 25, server_args: [--startup-delay, 120]")
    code = proc.wait(timeout=200)
    took = time.monotonic() - t0
    err = (tmp_path / "stderr.txt").read_text()
    assert code == 1, err[-3000:]
    assert "teacher server 0 did not become healthy within 25 s" in err and "restarting" not in err, err[-3000:]
    assert "dualrun: waiting for the teacher server" in err   # the ranks were running beside it
    assert took < 25 + 60, f"{took:.1f} s"   # the bound, then the ranks' and the server's stop on a loaded machine
    assert not list((tmp_path / "out").glob("step_*"))
    assert eventually(lambda: not pids_matching(str(tmp_path / "out"))), pids_matching(str(tmp_path / "out"))
    assert eventually(lambda: not pids_matching(str(module_tiny / "teacher"), "cpu_engine"))
    if backend == "ray":
        assert eventually(lambda: not cluster.alive_actors())
        assert eventually(lambda: not cluster.live_placement_groups())
