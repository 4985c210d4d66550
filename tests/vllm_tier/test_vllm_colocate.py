"""GRPO with a colocated vLLM rollout (`rollout.engine: vllm` in a colocate group): the unchanged GRPOTrainer gets
TRL's colocate mode from dualrun and builds vLLM's engine inside the trainer process, which then generates. (TRL's
in-place weight sync into that engine does not work on vLLM's CPU layers, so the probe stops after generating.)"""
from __future__ import annotations

import json

import pytest

from helpers import dualrun
from vllm_helpers import ASSETS, SERVER_ENV, TIER

pytestmark = [*TIER, pytest.mark.timeout(600)]


def test_grpo_builds_the_colocated_vllm_engine_from_the_filled_fields(tmp_path_factory, vllm_tiny):
    tmp = tmp_path_factory.mktemp("colocate")
    (tmp / "job.yaml").write_text("use_cpu: true\nmethod: grpo\nroles:\n  train: {gpus: 1}\n"
                                  "  rollout: {gpus: 1, engine: vllm}\ncolocate_groups: [[train, rollout]]\n"
                                  f"env: {SERVER_ENV}\n")
    (tmp / "out").mkdir()
    proc = dualrun("launch", "--config_file", "job.yaml", str(ASSETS / "grpo_colocate_probe.py"),
                   str(vllm_tiny / "model"), str(vllm_tiny / "data" / "prompts.jsonl"), "out", cwd=tmp, timeout=580)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rec = json.loads((tmp / "out" / "rank0.json").read_text())
    assert rec == {"use_vllm": True, "vllm_mode": "colocate", "vllm_tensor_parallel_size": 1,
                   "vllm_enable_sleep_mode": False, "engine": "LLM", "tokens": 4}
    assert "GRPOConfig: {'use_vllm': True, 'vllm_mode': 'colocate'" in proc.stderr
