"""The launching shell's CUDA_VISIBLE_DEVICES decides a job's GPUs, as it does for torchrun and accelerate.

torchrun: the plan (and so `dualrun plan`, the dry run and the real run) places ranks on the visible ids, not on
0..n-1. Ray: a cluster that is joined owns its GPUs (Ray maps each actor's GPU through the CUDA_VISIBLE_DEVICES
its node was started with), so the ranks get exactly those; only an embedded cluster is planned on the shell's ids.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from helpers import dualrun
from ray_helpers import DUMP_ENV, ray_env

GPU2 = "roles: {train: {gpus: 2}}\n"


def _envs(out: Path) -> list[dict[str, str]]:
    files = sorted(out.glob("env_*.json"), key=lambda p: int(p.stem.split("_")[1]))
    return [json.loads(p.read_text()) for p in files]


@pytest.fixture
def job(tmp_path):
    (tmp_path / "gpu2.yaml").write_text(GPU2)
    (tmp_path / "dump.py").write_text(DUMP_ENV)
    (tmp_path / "out").mkdir()
    return tmp_path


@pytest.mark.slow
def test_plan_and_dry_run_use_the_visible_gpus(job):
    env = {"CUDA_VISIBLE_DEVICES": "3,4", "DUALRUN_CACHE": "0"}
    plan = dualrun("plan", "--json", "--config_file", "gpu2.yaml", cwd=job, env=env)
    assert plan.returncode == 0, plan.stderr
    procs = json.loads(plan.stdout)["processes"]
    assert [p["devices"] for p in procs] == [[3], [4]]
    assert {p["env"]["CUDA_VISIBLE_DEVICES"] for p in procs} == {"3,4"}
    table = dualrun("plan", "--config_file", "gpu2.yaml", cwd=job, env=env)
    assert "GPU 3 " in table.stdout and "GPU 4 " in table.stdout and "GPU 0" not in table.stdout, table.stdout
    dry = dualrun("launch", "--dry_run", "--config_file", "gpu2.yaml", "dump.py", "out", cwd=job, env=env)
    assert dry.returncode == 0, dry.stderr
    assert "CUDA_VISIBLE_DEVICES=3,4 " in dry.stdout and "--nproc-per-node 2" in dry.stdout, dry.stdout


def test_ray_dry_run_of_an_embedded_cluster_uses_the_visible_gpus(job):
    env = ray_env(CUDA_VISIBLE_DEVICES="5,6", DUALRUN_CACHE="0")
    plan = dualrun("plan", "--json", "--backend", "ray", "--config_file", "gpu2.yaml", cwd=job, env=env)
    assert plan.returncode == 0, plan.stderr
    assert [p["devices"] for p in json.loads(plan.stdout)["processes"]] == [[5], [6]]


def test_unset_means_all_gpus(job):
    proc = dualrun("plan", "--json", "--config_file", "gpu2.yaml", cwd=job,
                   env={k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"} | {"DUALRUN_CACHE": "0"})
    assert proc.returncode == 0, proc.stderr
    assert [p["devices"] for p in json.loads(proc.stdout)["processes"]] == [[0], [1]]


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_torchrun_ranks_run_on_the_visible_gpus(job):
    """A real torchrun job (the script touches no GPU): each rank sees the shell's 3,4 and indexes them."""
    proc = dualrun("launch", "--config_file", "gpu2.yaml", "dump.py", "out", cwd=job,
                   env={"CUDA_VISIBLE_DEVICES": "3,4"})
    assert proc.returncode == 0, proc.stderr
    envs = _envs(job / "out")
    assert [(e["RANK"], e["LOCAL_RANK"], e["CUDA_VISIBLE_DEVICES"]) for e in envs] == [("0", "0", "3,4"),
                                                                                   ("1", "1", "3,4")]


@pytest.mark.ray
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ray_ranks_get_the_gpus_their_node_was_started_with(job, monkeypatch):
    """A Ray node started with CUDA_VISIBLE_DEVICES=3,4 (2 fake GPUs): Ray hands ranks those ids, whatever the
    launching shell says, and dualrun passes them on unchanged."""
    from ray_helpers import FakeGpuCluster

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,4")
    cluster = FakeGpuCluster(nodes=1, gpus=2, cpus=2)
    try:
        (job / "ray.yaml").write_text(GPU2 + f"ray: {{address: '{cluster.address}'}}\n")
        proc = dualrun("launch", "--backend", "ray", "--config_file", "ray.yaml", "dump.py", "out", cwd=job,
                       env=ray_env(CUDA_VISIBLE_DEVICES="0"))
        assert proc.returncode == 0, proc.stderr
        envs = _envs(job / "out")
        assert sorted(e["CUDA_VISIBLE_DEVICES"] for e in envs) == ["3", "4"]
        assert {e["LOCAL_RANK"] for e in envs} == {"0"}
    finally:
        cluster.shutdown()
