"""max_failures on both backends: SIGKILL a worker mid-run; the whole job restarts once and the unchanged
SFT trainer resumes from its newest checkpoint; with max_failures 0 the job fails naming the rank."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from helpers import REPO, pids_matching
from ray_helpers import ray_env

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(400)]


def _workers(marker: str) -> list[int]:
    return pids_matching(marker, "dualrun.rank.bootstrap")


def _run_and_kill(tmp_path, tiny, backend, max_failures, ray_address=""):
    out = f"out-{uuid.uuid4().hex[:8]}"
    (tmp_path / "job.yaml").write_text(f"use_cpu: true\nroles: {{train: {{gpus: 2}}}}\nmax_failures: {max_failures}\n")
    cmd = [sys.executable, "-m", "dualrun", "launch", "--backend", backend, "--config_file", "job.yaml",
           str(REPO / "examples" / "sft.py"), "--model_name_or_path", str(tiny / "model"), "--dataset_path",
           str(tiny / "data" / "sft.jsonl"), "--max_steps", "60", "--save_steps", "20", "--per_device_train_batch_size",
           "2", "--output_dir", out, "--seed", "1"]
    env = dict(os.environ, **ray_env(RAY_ADDRESS=ray_address))
    log = open(tmp_path / f"{out}.log", "w+")   # a file, not a pipe: a full pipe would stall the job
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + 240
    while not (tmp_path / out / "checkpoint-20" / "trainer_state.json").exists():   # written last: complete
        assert proc.poll() is None and time.monotonic() < deadline, "never reached the first checkpoint"
        time.sleep(0.05)
    victims = _workers(out)
    assert victims, "no worker process found"
    os.kill(victims[-1], signal.SIGKILL)
    proc.wait(timeout=300)
    log.seek(0)
    return proc.returncode, log.read(), tmp_path / out


@pytest.mark.parametrize("backend", ["torchrun", "ray"])
def test_killed_worker_restarts_and_resumes(tmp_path, tiny, backend, ray_cluster_if_ray):
    cluster = ray_cluster_if_ray   # Ray: the worker's running cluster; a restart there starts fresh actors
    code, log, out = _run_and_kill(tmp_path, tiny, backend, 1, cluster.address if cluster else "")
    assert code == 0, log[-4000:]
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 60
    steps = [h["step"] for h in state["log_history"] if "loss" in h]
    assert steps == list(range(1, 61)), steps  # every step logged exactly once: none lost, none counted twice
    assert log.count("restart 1: resuming from") == 1, log[-4000:]
    assert "restart 2" not in log
    assert not _workers(out.name)
    if cluster:
        cluster.assert_nothing_left()


@pytest.mark.parametrize("backend", ["torchrun", "ray"])
def test_killed_worker_without_restarts_fails_naming_the_rank(tmp_path, tiny, backend, ray_cluster_if_ray):
    cluster = ray_cluster_if_ray
    code, log, out = _run_and_kill(tmp_path, tiny, backend, 0, cluster.address if cluster else "")
    assert code != 0
    assert "train rank" in log and "SIGKILL" in log, log[-3000:]
    assert not _workers(out.name)
