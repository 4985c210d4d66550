"""GRPO against a real vLLM rollout server on both backends: dualrun starts the exact command it builds (TRL's
`vllm serve` flags, dev mode), health-checks it, and wires both TRL trainers to it: AsyncGRPOTrainer through
`vllm_server_base_url` (its client reaches the server's dev-mode endpoints) and GRPOTrainer in server mode, which
reaches the server and then, on a CPU, stops at weight-sync initialisation (NCCL needs CUDA). The job ends with that
error and the failing rank in one line, and nothing is left running."""
from __future__ import annotations

import json
import re

import pytest

from helpers import dualrun
from ray_helpers import ray_env
from vllm_helpers import ASSETS, TIER, assert_nothing_left, server_role

pytestmark = [*TIER, pytest.mark.timeout(600)]

NCCL_NEEDS_CUDA = "Weight synchronization runs on vLLM's NCCL weight-transfer engine, which needs a CUDA device"


@pytest.mark.parametrize("backend", ["torchrun", "ray"])
def test_grpo_trainers_reach_the_real_rollout_server(tmp_path, vllm_tiny, backend, ray_cluster_if_ray):
    cluster = ray_cluster_if_ray   # Ray: a running cluster
    (tmp_path / "job.yaml").write_text("use_cpu: true\nmethod: grpo\nroles:\n  train: {gpus: 1}\n"
                                       + server_role("rollout", vllm_tiny / "model"))
    (tmp_path / "out").mkdir()
    proc = dualrun("launch", "--backend", backend, "--config_file", "job.yaml", str(ASSETS / "grpo_server_probe.py"),
                   str(vllm_tiny / "model"), str(vllm_tiny / "data" / "prompts.jsonl"), "out", cwd=tmp_path,
                   env=ray_env(TRL_EXPERIMENTAL_SILENCE="1", RAY_ADDRESS=cluster.address if cluster else ""),
                   timeout=580)
    assert proc.returncode == 1, proc.stderr[-4000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("dualrun: error:")]
    assert len(errors) == 1 and "train rank 0 failed" in errors[0] and NCCL_NEEDS_CUDA in errors[0], errors
    rec = json.loads((tmp_path / "out" / "rank0.json").read_text())
    address = re.search(r"rollout: server healthy at ([\d.]+:\d+)", proc.stderr).group(1)
    host, port = address.split(":")
    assert rec["async_url"] == f"http://{address}"
    assert rec["async_server"] == {"dtype": "torch.float32", "world_size": 1}
    assert "CUDA" in rec["async_error"]  # TRL 1.16's AsyncGRPOTrainer reads the CUDA device name when built
    grpo = rec["grpo"]
    assert grpo["use_vllm"] and grpo["vllm_mode"] == "server"
    assert (grpo["vllm_server_host"], grpo["vllm_server_port"]) == (host, int(port))
    assert grpo["vllm_group_port"] not in (51216, int(port))
    assert_nothing_left(proc.stderr, str(tmp_path))
    if cluster:
        cluster.assert_nothing_left()
