"""A role's one engine (no router in front) that stops answering is found by its set's health probes, on both
backends, with real processes: SIGSTOPped mid-run while the trainers wait on it without a limit (as TRL's client
does), it is judged hung once its probes have failed for `request_timeout_s`, stopped (SIGKILL reaches a stopped
process), and the job ends naming it (role, index, address) — or, with `max_failures: 1`, restarts with a fresh
server and finishes. A server that answers late but within its probes' time is left alone. A router, which nothing
else probes, is probed and judged the same way."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import ASSETS, eventually, gone, pids_matching
from ray_helpers import ray_env

TIMEOUT_S = 10   # the teacher's request_timeout_s
# SIGSTOP -> the job's end: the timeout, up to two more probes (1 s apart, 5 s to fail each), the hung server's
# SIGTERM -> SIGKILL grace, and the job's teardown on a loaded 2-core machine
BOUND_S = TIMEOUT_S + 2 * (1 + 5) + 5 + 30
STEPS = 8


@pytest.fixture
def cluster(ray_cluster_if_ray):
    """The Ray cases: this worker's running cluster (conftest.ray_cluster); the torchrun ones start none."""
    return ray_cluster_if_ray


def _engines(tiny: Path) -> list[int]:
    return pids_matching(str(tiny / "teacher"), "cpu_engine")


def _start(tmp_path: Path, tiny: Path, backend: str, max_failures: int, cluster, replicas: int = 1,
           timeout: str = f", request_timeout_s: {TIMEOUT_S}") -> subprocess.Popen:
    (tmp_path / "job.yaml").write_text(
        f"use_cpu: true\nmethod: gkd\nmax_failures: {max_failures}\nroles:\n  train: {{gpus: 2}}\n"
        f"  teacher: {{gpus: {replicas}, model: {tiny / 'teacher'}, top_k: 5, health_timeout_s: 90{timeout}}}\n")
    (tmp_path / "out").mkdir()
    env = dict(os.environ, **ray_env(RAY_ADDRESS=cluster.address if backend == "ray" else ""))
    return subprocess.Popen([sys.executable, "-m", "dualrun", "launch", "--backend", backend, "--config_file",
                             "job.yaml", str(ASSETS / "uses_teacher.py"), str(tmp_path / "out"), str(STEPS), "none"],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=(tmp_path / "stderr.txt").open("w"), text=True)


def _training(tmp_path: Path, driver: subprocess.Popen) -> None:
    """Wait for both ranks to have trained a step (each has used the teacher's address)."""
    out = tmp_path / "out"
    assert eventually(lambda: driver.poll() is not None or ((out / "step_0_1").exists() and
                                                            (out / "step_1_1").exists()), timeout=150)
    assert driver.poll() is None, (tmp_path / "stderr.txt").read_text()[-3000:]


def _stop_server_mid_training(tmp_path: Path, tiny: Path, driver: subprocess.Popen) -> tuple[int, float]:
    """Once both ranks trained a step, SIGSTOP the teacher's engine; (its pid, when)."""
    _training(tmp_path, driver)
    (pid,) = _engines(tiny)
    os.kill(pid, signal.SIGSTOP)
    return pid, time.monotonic()


def _release(pid: int) -> None:
    """A test that failed midway leaves no stopped engine behind."""
    if not gone(pid):
        os.kill(pid, signal.SIGKILL)


def _assert_nothing_left(tiny: Path, cluster, backend: str) -> None:
    """No teacher engine left, and on Ray no actor or placement group."""
    assert eventually(lambda: not _engines(tiny)), _engines(tiny)
    if backend == "ray":
        assert eventually(lambda: not cluster.alive_actors())
        assert eventually(lambda: not cluster.live_placement_groups())


HUNG_LINE = (r"dualrun: teacher server 0 is hung \(at ([\d.]+:\d+): health probe not answered within 5 s; its health "
             rf"probes failed for [\d.]+ s, request_timeout_s is {TIMEOUT_S}\); stopping it \(SIGTERM, then SIGKILL "
             r"after 5 s\)")


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["torchrun", "ray"])
def test_a_hung_lone_server_ends_the_job_within_its_timeout_naming_it(tmp_path, module_tiny, cluster, backend):
    driver = _start(tmp_path, module_tiny, backend, 0, cluster)
    pid = None
    try:
        pid, stopped = _stop_server_mid_training(tmp_path, module_tiny, driver)
        time.sleep(TIMEOUT_S - 1)
        assert driver.poll() is None, "judged hung before request_timeout_s"
        assert SILENT_LINE in (tmp_path / "stderr.txt").read_text(), "no line while it waits on the server"
        code = driver.wait(timeout=BOUND_S)
        took = time.monotonic() - stopped
    finally:
        if driver.poll() is None:
            driver.kill()
        if pid is not None:
            _release(pid)
    err = (tmp_path / "stderr.txt").read_text()
    assert code == 1, err[-3000:]
    assert took < BOUND_S, f"{took:.1f} s"
    address = re.search(HUNG_LINE, err).group(1)
    errors = [ln for ln in err.splitlines() if ln.startswith("dualrun: error:")]
    assert len(errors) == 1 and errors[0].startswith(
        f"dualrun: error: teacher server 0 at {address} stopped answering while the job was running (health probe "
        "not answered within 5 s; its health probes failed for "), errors
    assert f"request_timeout_s is {TIMEOUT_S}); it was stopped" in errors[0], errors
    assert not (tmp_path / "out" / f"step_0_{STEPS - 1}").exists()
    assert gone(pid), "the stopped engine was left behind"
    assert eventually(lambda: not pids_matching(str(tmp_path / "out"))), pids_matching(str(tmp_path / "out"))
    _assert_nothing_left(module_tiny, cluster, backend)


SILENT_LINE = "dualrun: teacher server 0 has not answered its health check for "


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["torchrun", "ray"])
def test_a_hung_lone_server_with_the_defaults_says_so_within_10_s(tmp_path, module_tiny, cluster, backend):
    """request_timeout_s unset (1800 s): the job waits on the stopped server, but not in silence; Ctrl-C (SIGINT to
    the launcher) then leaves nothing behind."""
    driver = _start(tmp_path, module_tiny, backend, 0, cluster, timeout="")
    pid = None
    try:
        pid, stopped = _stop_server_mid_training(tmp_path, module_tiny, driver)
        assert eventually(lambda: SILENT_LINE in (tmp_path / "stderr.txt").read_text(), timeout=10), \
            (tmp_path / "stderr.txt").read_text()[-3000:]
        took = time.monotonic() - stopped
        assert driver.poll() is None, "judged hung long before request_timeout_s (1800 s)"
        driver.send_signal(signal.SIGINT)
        driver.wait(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
        if pid is not None:
            _release(pid)
    err = (tmp_path / "stderr.txt").read_text()
    line = next(ln for ln in err.splitlines() if ln.startswith(SILENT_LINE))
    assert "request_timeout_s (1800 s)" in line and "health probe not answered within 5 s" in line, line
    assert took < 10, f"{took:.1f} s"
    _assert_nothing_left(module_tiny, cluster, backend)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("backend", ["torchrun", "ray"])
def test_max_failures_restarts_a_job_whose_lone_server_hung(tmp_path, module_tiny, cluster, backend):
    driver = _start(tmp_path, module_tiny, backend, 1, cluster)
    pid = None
    try:
        pid, _ = _stop_server_mid_training(tmp_path, module_tiny, driver)
        code = driver.wait(timeout=BOUND_S + 150)
    finally:
        if driver.poll() is None:
            driver.kill()
        if pid is not None:
            _release(pid)
    err = (tmp_path / "stderr.txt").read_text()
    assert code == 0, err[-3000:]
    address = re.search(HUNG_LINE, err).group(1)
    assert f"teacher server 0 at {address} stopped answering while the job was running" in err
    assert "restarting the job" in err and "after 1 restart(s)" in err, err[-3000:]
    out = tmp_path / "out"
    assert all((out / f"step_{r}_{s}").exists() for r in (0, 1) for s in range(STEPS))
    assert (out / "address_1_0.json").read_text().strip('"') != address   # a fresh server on a fresh port
    assert gone(pid)
    _assert_nothing_left(module_tiny, cluster, backend)


@pytest.mark.slow   # ~20 s of watching; no torchrun, no Ray
def test_a_slow_lone_server_is_left_alone_and_a_stopped_one_is_stopped(tmp_path):
    """The set's probes on a real process: health answered 1.5 s late (each probe has 5 s) through 8 s of watching
    with `request_timeout_s: 1` is no event; SIGSTOPped, the server is judged hung, killed and reported."""
    from dualrun.config import build_config
    from dualrun.methods.plugin import get_plugin
    from dualrun.plan.processes import make_plan
    from dualrun.plan.server_commands import with_commands
    from dualrun.servers.local import LocalServers

    cfg = build_config({"method": "gkd", "use_cpu": True, "log_dir": str(tmp_path), "roles": {
        "train": {"gpus": 1}, "teacher": {"gpus": 1, "model": "m", "top_k": 5, "request_timeout_s": 1,
                                         "health_timeout_s": 30}}}, "job.yaml")
    get_plugin("gkd").validate(cfg)
    plan = with_commands(make_plan(cfg), lambda p, host, port, _: [sys.executable, str(ASSETS / "slow_health.py"),
                                                                   host, port, "1.5"], lambda p: "/health")
    servers = LocalServers(plan, lambda p: dict(os.environ), stream=None)
    with servers:
        servers.start()
        server = servers.running[0]
        servers.watch()
        time.sleep(8)
        assert servers.failure is None and server.alive()
        os.kill(server.proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        death = servers.next_death(timeout=40)
        assert death is not None and death.index == 0, death
        assert time.monotonic() - stopped >= 1
        assert death.one_line().startswith(f"teacher server 0 at {server.address} stopped answering while the job "
                                           "was running (health probe not answered within 5 s"), death.one_line()
        assert gone(server.proc.pid) and not server.alive()
    assert not servers.running


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["torchrun", "ray"])
def test_a_hung_router_ends_the_job_within_its_timeout_naming_it(tmp_path, module_tiny, cluster, backend):
    """The router in front of two replicas, SIGSTOPped while the ranks call it without a limit: nothing else probes
    it, so its set does (its table's path: its /health answers for its replicas), and it is judged as a lone
    server is."""
    driver = _start(tmp_path, module_tiny, backend, 0, cluster, replicas=2)
    pid = None
    try:
        _training(tmp_path, driver)   # the ranks have used the router
        assert len(_engines(module_tiny)) == 2
        address = json.loads((tmp_path / "out" / "address_0_0.json").read_text())
        (pid,) = pids_matching("dualrun.programs.router", f"--port {address.rsplit(':', 1)[1]}")
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        code = driver.wait(timeout=BOUND_S)
        took = time.monotonic() - stopped
    finally:
        if driver.poll() is None:
            driver.kill()
        if pid is not None:
            _release(pid)
    err = (tmp_path / "stderr.txt").read_text()
    assert code == 1, err[-3000:]
    assert took < BOUND_S, f"{took:.1f} s"
    errors = [ln for ln in err.splitlines() if ln.startswith("dualrun: error:")]
    assert len(errors) == 1 and errors[0].startswith(
        f"dualrun: error: teacher router at {address} stopped answering while the job was running (health probe "
        "not answered within 5 s; its health probes failed for "), errors
    assert gone(pid), "the stopped router was left behind"
    _assert_nothing_left(module_tiny, cluster, backend)
