"""An accelerate DeepSpeed ZeRO-2 config trains the unchanged SFT example on CPU under both backends."""
from __future__ import annotations

import importlib.util
import json

import pytest

from helpers import REPO, dualrun, link_tiny
from ray_helpers import ray_env

# found, not imported: importing deepspeed (torch with it) at collection costs every test worker seconds
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")]


def test_zero2_sft_on_both_backends(tmp_path, tiny, ray_cluster):
    link_tiny(tiny, tmp_path)
    args = [str(REPO / "examples" / "sft.py"), "--model_name_or_path", "tiny/model", "--dataset_path",
            "tiny/data/sft.jsonl", "--max_steps", "4", "--save_steps", "4", "--seed", "5"]
    losses = {}
    for backend in ("torchrun", "ray"):
        proc = dualrun("launch", "--backend", backend, "--config_file", str(REPO / "configs" / "sft_zero2_cpu.yaml"),
                       *args, "--output_dir", f"out_{backend}", cwd=tmp_path, env=ray_env(RAY_ADDRESS=ray_cluster.address), timeout=500)
        assert proc.returncode == 0, proc.stderr[-3000:]
        ckpt = tmp_path / f"out_{backend}" / "checkpoint-4" / "global_step4"
        # ZeRO-2: the optimizer state is sharded, one file per rank -> DeepSpeed really ran on 2 ranks
        assert sorted(p.name for p in ckpt.glob("*optim_states.pt")) == [
            "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
        history = json.loads((tmp_path / f"out_{backend}" / "trainer_state.json").read_text())["log_history"]
        losses[backend] = [h["loss"] for h in history if "loss" in h]
    assert len(losses["torchrun"]) == 4 and losses["ray"] == losses["torchrun"]
    ray_cluster.assert_nothing_left()
