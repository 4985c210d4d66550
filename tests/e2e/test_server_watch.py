"""Servers are watched, on both backends, with real processes: the built-in CPU engine serving a teacher is
SIGKILLed by pid mid-training. The job ends within 10 s naming the server, its exit code and its log's last
lines, and leaves nothing behind; with max_failures: 1 it restarts with a fresh server on a fresh port and finishes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import ASSETS, eventually, pids_matching
from ray_helpers import ray_env

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 8


@pytest.fixture
def cluster(ray_cluster_if_ray):
    """The Ray cases: this worker's running cluster (conftest.ray_cluster); the torchrun ones start none."""
    return ray_cluster_if_ray


def _server_pids(tiny: Path) -> list[int]:
    return pids_matching(str(tiny / "teacher"), "cpu_engine")


def _start(tmp_path: Path, tiny: Path, backend: str, max_failures: int, cluster) -> subprocess.Popen:
    (tmp_path / "job.yaml").write_text(
        f"use_cpu: true\nmethod: gkd\nmax_failures: {max_failures}\nroles:\n  train: {{gpus: 2}}\n"
        f"  teacher: {{gpus: 1, model: {tiny / 'teacher'}, top_k: 5, health_timeout_s: 90}}\n")
    (tmp_path / "out").mkdir()
    env = dict(os.environ, **ray_env(RAY_ADDRESS=cluster.address if backend == "ray" else ""))
    return subprocess.Popen([sys.executable, "-m", "dualrun", "launch", "--backend", backend, "--config_file",
                             "job.yaml", str(ASSETS / "uses_teacher.py"), str(tmp_path / "out"), str(STEPS)],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _kill_server_mid_training(tmp_path: Path, tiny: Path, driver: subprocess.Popen) -> tuple[int, float]:
    """Wait for both ranks to have trained a step, then SIGKILL the server; (its pid, when)."""
    out = tmp_path / "out"
    assert eventually(lambda: (out / "step_0_1").exists() and (out / "step_1_1").exists(), timeout=150), \
        driver.stderr.read() if driver.poll() is not None else "no step yet"
    (pid,) = _server_pids(tiny)
    os.kill(pid, signal.SIGKILL)
    return pid, time.monotonic()


@pytest.mark.parametrize("backend", ["torchrun", "ray"])
def test_a_dead_server_ends_the_job_within_10_s_naming_it(tmp_path, module_tiny, cluster, backend):
    driver = _start(tmp_path, module_tiny, backend, 0, cluster)
    _, killed = _kill_server_mid_training(tmp_path, module_tiny, driver)
    code = driver.wait(timeout=60)
    took = time.monotonic() - killed
    err = driver.stderr.read()
    assert code == 1, err[-3000:]
    assert took < 10, f"{took:.1f} s"
    assert "dualrun: error: teacher server 0 exited with code -9 (killed by SIGKILL) while the job was running" in err
    assert "--- last lines of its log ---" in err and "dualrun engine" in err.split("last lines of its log")[-1]
    assert not (tmp_path / "out" / f"step_0_{STEPS - 1}").exists()
    assert eventually(lambda: not pids_matching(str(tmp_path / "out"))), pids_matching(str(tmp_path / "out"))
    assert not _server_pids(module_tiny)
    if backend == "ray":
        assert eventually(lambda: not cluster.alive_actors()) and eventually(lambda: not cluster.live_placement_groups())


def assert_restarted_once(driver: subprocess.Popen, out: Path, label: str) -> str:
    """The job ran to the end after one restart for the killed server `label`, on a fresh address (returned);
    uses_teacher.py's records in `out`."""
    code = driver.wait(timeout=200)
    err = driver.stderr.read()
    assert code == 0, err[-3000:]
    assert f"{label} exited with code -9 (killed by SIGKILL) while the job was running" in err
    assert "restarting the job" in err and "after 1 restart(s)" in err
    first, second = (json.loads((out / f"address_{a}_0.json").read_text()) for a in (0, 1))
    assert first != second, "a restart must never reuse the dead server's address"
    assert all((out / f"step_{r}_{s}").exists() for r in (0, 1) for s in range(STEPS))
    return second


@pytest.mark.parametrize("backend", ["torchrun", "ray"])
def test_max_failures_restarts_with_a_fresh_server_on_a_fresh_port(tmp_path, module_tiny, cluster, backend):
    driver = _start(tmp_path, module_tiny, backend, 1, cluster)
    _kill_server_mid_training(tmp_path, module_tiny, driver)
    out = tmp_path / "out"
    second = assert_restarted_once(driver, out, "teacher server 0")
    assert json.loads((out / "address_1_1.json").read_text()) == second
    assert eventually(lambda: not _server_pids(module_tiny))


def test_multi_node_torchrun_servers_take_free_ports(tmp_path, module_tiny):
    """Two machines by hand (one host): machine 0 starts the teacher on a free port; machine 1's ranks read its
    address from torchrun's store. Both ranks use the same server; nothing sits on main_process_port + 1."""
    from dualrun.light.ports import free_port

    port = free_port()
    (tmp_path / "job.yaml").write_text(
        f"use_cpu: true\nmethod: gkd\nroles:\n  train: {{gpus: 2}}\n"
        f"  teacher: {{gpus: 1, model: {module_tiny / 'teacher'}, top_k: 5, health_timeout_s: 90}}\n")
    (tmp_path / "out").mkdir()
    cmd = [sys.executable, "-m", "dualrun", "launch", "--config_file", "job.yaml", "--num_machines", "2",
           "--machine_rank", "{rank}", "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
           str(ASSETS / "uses_teacher.py"), str(tmp_path / "out"), "2"]
    procs = [subprocess.Popen([c.format(rank=r) for c in cmd], cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=200) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    seen = [json.loads((tmp_path / "out" / f"address_0_{r}.json").read_text()) for r in (0, 1)]
    assert seen[0] == seen[1] and seen[0].startswith("127.0.0.1:")
    assert int(seen[0].rpartition(":")[2]) != port + 1
    assert all((tmp_path / "out" / f"step_{r}_1").exists() for r in (0, 1))
    assert eventually(lambda: not _server_pids(module_tiny))
