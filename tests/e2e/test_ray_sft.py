"""The promise itself: the unchanged TRL SFT example gives the same losses on torchrun and on Ray (embedded cluster)."""
from __future__ import annotations

import json

import pytest

from helpers import REPO, dualrun, link_tiny, pids_matching
from dualrun.light.progress import looks_like_bar
from ray_helpers import ray_env

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(400)]

SFT = REPO / "examples" / "sft.py"
TINY = REPO / "examples" / "make_tiny_model.py"


@pytest.mark.ray
@pytest.mark.skipif(not (SFT.exists() and TINY.exists()), reason="examples/sft.py not there yet")
def test_sft_losses_equal_on_torchrun_and_ray(tmp_path, tiny):
    link_tiny(tiny, tmp_path)   # under tmp_path: the leftover check below finds the workers by that path
    (tmp_path / "cpu2.yaml").write_text("use_cpu: true\nroles: {train: {gpus: 2}}\n")
    args = [str(SFT), "--model_name_or_path", str(tmp_path / "tiny" / "model"), "--dataset_path", "tiny/data/sft.jsonl",
            "--seed", "7",
            "--save_strategy", "no"]
    env = ray_env()
    losses = {}
    for backend in ("torchrun", "ray"):
        proc = dualrun("launch", "--backend", backend, "--config_file", "cpu2.yaml", *args, "--output_dir",
                       f"out_{backend}", cwd=tmp_path, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        history = json.loads((tmp_path / f"out_{backend}" / "trainer_state.json").read_text())["log_history"]
        losses[backend] = [h["loss"] for h in history if "loss" in h]
        if backend == "ray":   # the 8-step bar stays readable: rank 0 only, not one line per redraw
            bars = [ln for ln in proc.stderr.splitlines() if looks_like_bar(ln)]
            assert all(ln.startswith("[train rank 0] ") for ln in bars), bars
            assert 1 <= sum("/8 [" in ln for ln in bars) <= 4, bars   # first, last, one per 10 s (not 9+ per rank)
    assert len(losses["ray"]) >= 4
    assert losses["ray"] == losses["torchrun"]
    assert not pids_matching(env["RAY_TMPDIR"]) and not pids_matching(str(tmp_path))
