"""A GRPO rollout fleet on real vLLM CPU engines grows 1 -> 2 -> 1 while TRL's unchanged GRPOTrainer trains
(`dualrun scale`, torchrun on one machine): the joining replica takes the trainer's weights before it serves (held
out of rotation until its first update), every replica in rotation serves the trainer's weights of the last sync at
every step, and the training equals the same job on a fixed fleet of one, bit for bit (the same completions,
rewards and losses: rollout seeds do not depend on how many engines share a step)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ASSETS, eventually
from vllm_helpers import TIER, assert_grew_as_fixed, assert_nothing_left, server_role

pytestmark = [*TIER, pytest.mark.timeout(900)]


def _job(tmp_path: Path, tiny: Path, *probe: str) -> subprocess.Popen:
    (tmp_path / "job.yaml").write_text("use_cpu: true\nmethod: grpo\nlog_dir: logs\nroles:\n  train: {gpus: 1}\n"
                                       + server_role("rollout", tiny / "model", gpus=1, health_timeout_s=400,
                                                     processes=True, max_replicas=2))
    (tmp_path / "out").mkdir()
    env = dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1", DUALRUN_JOBS_DIR=str(tmp_path / "jobs"))
    with open(tmp_path / "stderr.txt", "w") as errors:
        return subprocess.Popen([sys.executable, "-m", "dualrun", "launch", "--backend", "torchrun", "--config_file",
                                 "job.yaml", str(ASSETS / "grpo_fleet_probe.py"), str(tiny / "model"),
                                 str(tiny / "data" / "prompts.jsonl"), "out", *probe],
                                cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=errors, text=True)


def _scale(tmp_path: Path, n: int) -> subprocess.Popen:
    env = dict(os.environ, DUALRUN_JOBS_DIR=str(tmp_path / "jobs"))
    return subprocess.Popen([sys.executable, "-m", "dualrun", "scale", "rollout", str(n)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_rollout_fleet_grows_and_shrinks_mid_run_and_trains_as_a_fixed_one(tmp_path, vllm_tiny):
    fixed, grown = tmp_path / "fixed", tmp_path / "grown"
    fixed.mkdir()
    grown.mkdir()
    driver = _job(fixed, vllm_tiny, "--fixed")
    assert driver.wait(timeout=600) == 0, (fixed / "stderr.txt").read_text()[-4000:]
    reference = json.loads((fixed / "out" / "rank0.json").read_text())

    driver = _job(grown, vllm_tiny)
    err = lambda: (grown / "stderr.txt").read_text()  # noqa: E731
    try:
        assert eventually(lambda: (grown / "out" / "grow_now").exists() or driver.poll() is not None, timeout=500,
                          every=0.5), err()[-4000:]
        assert driver.poll() is None, err()[-4000:]
        up = _scale(grown, 2)   # answers once the replica serves: after this step's sync
        assert eventually(lambda: (grown / "out" / "shrink_now").exists() or driver.poll() is not None,
                          timeout=500, every=0.5), err()[-4000:]
        said = up.communicate(timeout=60)[0]
        assert up.returncode == 0 and "rollout: 2 replicas now" in said, said
        down = _scale(grown, 1)
        said = down.communicate(timeout=120)[0]
        assert down.returncode == 0 and "rollout: 1 replicas now" in said, said
        code = driver.wait(timeout=400)
    finally:
        if driver.poll() is None:
            driver.kill()
    text = err()
    assert code == 0, text[-4000:]
    assert re.search(r"dualrun: rollout server 1 is healthy at [\d.]+:\d+; out of rotation until it holds the "
                     r"trainer's weights", text), text[-3000:]
    # it took the trainer's weights at the sync of global step 1 (grown at that step's start): it serves from there,
    # as the line, the router's row and the job's summary say
    assert re.search(r"dualrun: rollout server 1 joined at [\d.]+:\d+, serving from step 1, [\d.]+ s after the "
                     r"resize asked for it", text), text[-3000:]
    assert re.search(r"dualrun: fleet: rollout server 1 joined [\d.]+ s after the resize asked for it \(its engine "
                     r"started in [\d.]+ s\), serving from step 1; rollout server 1 left \(scaled down\)", text), \
        text[-3000:]
    assert "dualrun: rollout server 1 left (scaled down); 1 of min 1 remain" in text
    rec = json.loads((grown / "out" / "rank0.json").read_text())
    joined, left = rec["rows"]["joined"][1], rec["rows"]["left"][1]
    assert joined["from_step"] is None and rec["rows"]["serving"][1]["from_step"] == 1
    assert left["address"] == "-"
    # weights first, none stale, the same training as on a fixed fleet of one, bit for bit
    assert_grew_as_fixed(rec, reference, (grown / "logs" / "rollout-server-1.log").read_text())
    assert_nothing_left(text, str(grown))
