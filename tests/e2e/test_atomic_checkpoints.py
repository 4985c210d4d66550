"""No half-written checkpoint: a dualrun job's Trainer saves `checkpoint-N` into a staging folder and renames it once
every rank has written its part (dualrun/rank/atomic_save.py). The publishing step alone first (several claimants, a
stale staging folder, the same step saved again), then a real torchrun job whose rank 0 is SIGKILLed inside a save:
no `checkpoint-*` folder is ever partial, the restart resumes from the last complete one, and the leftover staging
folder is gone at the end."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from dualrun.rank.atomic_save import publish, set_aside
from dualrun.rank.resume import last_complete_checkpoint
from helpers import ASSETS


def _staged(run_dir, step: int, files: dict[str, str]) -> str:
    staging = run_dir / f"tmp-checkpoint-{step}"
    folder = staging / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    return str(staging)


def test_one_claimant_publishes_the_whole_folder_and_the_leftovers_go(tmp_path):
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text("{}")
    _staged(tmp_path, 2, {"rng_state_1.pth": "old"})   # a save of step 2 killed earlier
    staging = _staged(tmp_path, 4, {"model.safetensors": "w", "rng_state_0.pth": "0", "rng_state_1.pth": "1",
                                    "trainer_state.json": "{}"})
    assert last_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-2")   # staging is no checkpoint
    assert publish(staging, "checkpoint-4", str(tmp_path)) is True
    assert publish(staging, "checkpoint-4", str(tmp_path)) is False   # a second process: published already
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "checkpoint-4"]
    assert sorted(os.listdir(tmp_path / "checkpoint-4")) == ["model.safetensors", "rng_state_0.pth",
                                                             "rng_state_1.pth", "trainer_state.json"]
    assert last_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-4")


def test_the_same_step_saved_again_replaces_the_old_folder(tmp_path):
    (tmp_path / "checkpoint-4").mkdir()
    (tmp_path / "checkpoint-4" / "stale.bin").write_text("x")
    staging = _staged(tmp_path, 4, {"trainer_state.json": "{}"})
    assert publish(staging, "checkpoint-4", str(tmp_path))
    assert os.listdir(tmp_path) == ["checkpoint-4"] and os.listdir(tmp_path / "checkpoint-4") == ["trainer_state.json"]


def test_a_stale_staging_folder_is_set_aside_and_removed_by_the_next_publish(tmp_path):
    staging = _staged(tmp_path, 4, {"rng_state_3.pth": "from a killed save"})
    set_aside(staging)
    set_aside(staging)   # another rank: moved already
    assert not os.path.exists(staging)
    staging = _staged(tmp_path, 4, {"trainer_state.json": "{}"})
    assert publish(staging, "checkpoint-4", str(tmp_path))
    assert os.listdir(tmp_path) == ["checkpoint-4"] and os.listdir(tmp_path / "checkpoint-4") == ["trainer_state.json"]


CONFIGS = {"ddp": "use_cpu: true\nroles: {train: {gpus: 2}}\nmax_failures: 1\n",
           "deepspeed": "distributed_type: DEEPSPEED\ndeepspeed_config: {zero_stage: 2}\nmixed_precision: 'no'\n"
                        "roles: {train: {gpus: 0, processes: 2}}\nmax_failures: 1\n"}


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", ["ddp", pytest.param("deepspeed", marks=pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed"))])
def test_a_rank_killed_mid_save_leaves_no_partial_checkpoint_and_resumes_from_the_last_whole_one(tmp_path, tiny,
                                                                                                 layout):
    """DDP (each rank's RNG state in the folder) and DeepSpeed ZeRO-2 (its sharded optimizer states and `latest`)."""
    out, listing = tmp_path / "out", tmp_path / "listing.json"
    (tmp_path / "job.yaml").write_text(CONFIGS[layout])
    cmd = [sys.executable, "-m", "dualrun", "launch", "--config_file", "job.yaml", str(ASSETS / "killed_mid_save.py"),
           "--model_name_or_path", str(tiny / "model"), "--dataset_path", str(tiny / "data" / "sft.jsonl"),
           "--output_dir", str(out), "--kill_step", "4", "--listing", str(listing)]
    cmd += ["--deepspeed_on_cpu"] if layout == "deepspeed" else []
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=360)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    seen = json.loads(listing.read_text())   # the output folder right after the kill, before the restart resumed
    assert {name: whole for name, whole in seen.items() if name.startswith("checkpoint-")} == {"checkpoint-2": True}, seen
    assert "tmp-checkpoint-4" in seen, seen   # the kill landed inside the save of step 4
    assert f"restart 1: resuming from {out / 'checkpoint-2'}" in log, log[-4000:]
    names = sorted(os.listdir(out))
    assert [n for n in names if "checkpoint" in n] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"], names
    for name in ("checkpoint-2", "checkpoint-4", "checkpoint-6"):
        files = set(os.listdir(out / name))
        assert {"trainer_state.json", "model.safetensors", "rng_state_0.pth", "rng_state_1.pth"} <= files, (name, files)
    assert json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())["global_step"] == 6
    if layout == "deepspeed":   # its own checkpoint inside: every rank's optimizer shard, and the tag it resumes from
        for name in ("checkpoint-4", "checkpoint-6"):
            assert (out / name / "latest").read_text().strip() == f"global_step{name.split('-')[1]}"
            shards = sorted(p.name for p in (out / name / f"global_step{name.split('-')[1]}").glob("*optim_states.pt"))
            assert shards == ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]


BEST = """
import json, os, sys
from dualrun.rank.atomic_save import activate
activate()
from datasets import load_dataset
from trl import SFTConfig, SFTTrainer
tiny, out = sys.argv[1], sys.argv[2]
data = load_dataset("json", data_files=f"{tiny}/data/sft.jsonl", split="train")
args = SFTConfig(output_dir=out, max_steps=2, save_steps=1, eval_strategy="steps", eval_steps=1,
                 load_best_model_at_end=True, metric_for_best_model="loss", save_total_limit=1,
                 per_device_train_batch_size=2, per_device_eval_batch_size=2, max_length=64, bf16=False,
                 use_cpu=True, report_to="none", activation_checkpointing=False)
trainer = SFTTrainer(model=f"{tiny}/model", args=args, train_dataset=data, eval_dataset=data.select(range(4)))
trainer.train()
print(json.dumps({"best": trainer.state.best_model_checkpoint, "step": trainer.state.best_global_step}))
"""


@pytest.mark.slow
def test_one_process_with_the_best_model_kept_names_the_published_folder(tmp_path, tiny):
    """One process, no torchrun: the best checkpoint's path (in the trainer's state and in each saved
    trainer_state.json) is the published `checkpoint-N`, never the staging folder; the rotation keeps the best."""
    proc = subprocess.run([sys.executable, "-c", BEST, str(tiny), str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    best = json.loads(proc.stdout.strip().splitlines()[-1])
    assert best["best"] == str(tmp_path / "out" / f"checkpoint-{best['step']}")
    assert not [n for n in os.listdir(tmp_path / "out") if n.startswith("tmp-")]
    for folder in (tmp_path / "out").glob("checkpoint-*"):
        state = json.loads((folder / "trainer_state.json").read_text())
        assert "tmp-" not in (state["best_model_checkpoint"] or ""), state["best_model_checkpoint"]
