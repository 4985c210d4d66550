"""GRPO in vLLM server mode against a real vLLM rollout server, on both backends, and TRL's AsyncGRPOTrainer wired
to it through `vllm_server_base_url`. dualrun starts the exact command it builds (TRL's `vllm serve` flags, dev
mode), the trainer reaches it (health, models, the weight-transfer engine's server info) and then, on a CPU, TRL
stops at weight-sync initialisation (NCCL needs CUDA): the job ends with that error and the failing rank in one
line, and nothing is left running."""
from __future__ import annotations

import json
import re

import pytest

from conftest import dualrun
from ray_helpers import ray_env
from vllm_helpers import ASSETS, REPO, TIER, assert_nothing_left, server_role, tiny_vllm

pytestmark = [*TIER, pytest.mark.timeout(400)]

NCCL_NEEDS_CUDA = "Weight synchronization runs on vLLM's NCCL weight-transfer engine, which needs a CUDA device"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_vllm(tmp_path_factory)


def _job(tmp_path, tiny, backend, *script):
    (tmp_path / "job.yaml").write_text("use_cpu: true\nmethod: grpo\nroles:\n  train: {gpus: 1}\n"
                                       + server_role("rollout", tiny / "model"))
    (tmp_path / "out").mkdir()
    return dualrun("launch", "--backend", backend, "--config_file", "job.yaml", *script, cwd=tmp_path,
                   env=ray_env(TRL_EXPERIMENTAL_SILENCE="1"), timeout=380)


def _one_error_line(stderr: str, text: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("dualrun: ") and "train rank 0" in ln and text in ln]
    assert lines, stderr[-4000:]
    return lines[-1]


@pytest.mark.parametrize("backend", ["torchrun", "ray"])
def test_grpo_server_mode_reaches_the_real_rollout_server(tmp_path, tiny, backend):
    proc = _job(tmp_path, tiny, backend, str(REPO / "examples" / "grpo.py"), "--model_name_or_path",
                str(tiny / "model"), "--dataset_path", str(tiny / "data" / "prompts.jsonl"), "--output_dir", "out",
                "--use_cpu", "true", "--max_steps", "1")
    assert proc.returncode != 0
    _one_error_line(proc.stderr, NCCL_NEEDS_CUDA)
    filled = re.search(r"GRPOConfig: (\{.*\}) \(rollout server\)", proc.stderr).group(1)
    assert "'vllm_mode': 'server'" in filled and "'vllm_group_port'" in filled
    assert "weight_transfer_config" in proc.stderr or "--weight-transfer-config" in proc.stderr
    assert_nothing_left(proc.stderr, str(tiny / "model"))


def test_async_grpo_is_wired_to_the_real_rollout_server(tmp_path, tiny):
    proc = _job(tmp_path, tiny, "torchrun", str(ASSETS / "async_grpo_probe.py"), str(tiny / "model"),
                str(tiny / "data" / "prompts.jsonl"), "out")
    rec = json.loads((tmp_path / "out" / "rank0.json").read_text())
    address = re.search(r"AsyncGRPOConfig: \{'vllm_server_base_url': 'http://([\d.]+:\d+)'\}", proc.stderr)
    assert address and rec["vllm_server_base_url"] == f"http://{address.group(1)}", proc.stderr[-4000:]
    assert proc.returncode != 0  # on a CPU: TRL's NCCL weight-transfer group cannot be set up
    _one_error_line(proc.stderr, "weight-transfer")
    assert_nothing_left(proc.stderr, str(tiny / "model"))
