"""Two real vLLM CPU engines behind dualrun's router: `{gpus: 2, engine: vllm}` on CPU is two replicas (one vLLM
engine per process) behind one address.
- A GKD teacher: the unchanged GKDTrainer distils from the router's address for a few steps, both replicas answer
  scoring requests, and everything is stopped with nothing left behind.
- A GRPO rollout: the unchanged GRPOTrainer trains 4 steps and its weights reach both replicas at every step, over
  one gloo group of world size 1 + 2 (the trainer rank 0, the replicas at rank offsets 1 and 2, as the router's
  fan-out gives them); after each sync both replicas serve the trainer's weights."""
from __future__ import annotations

import re

import pytest

from vllm_helpers import (TIER, assert_every_sync_landed, assert_nothing_left, run_gkd_probe, run_grpo_probe,
                          server_role)

pytestmark = [*TIER, pytest.mark.timeout(600)]


def test_gkd_distils_from_two_vllm_replicas_behind_the_router(tmp_path, vllm_tiny):
    job = ("use_cpu: true\nmethod: gkd\nlog_dir: logs\nroles:\n  train: {gpus: 1}\n"
           + server_role("teacher", vllm_tiny / "teacher", gpus=2, health_timeout_s=400, top_k=5))
    proc, rank = run_gkd_probe(tmp_path, vllm_tiny, job, timeout=580)
    assert all(x == x and x >= 0 for x in rank["losses"])
    router_log = (tmp_path / "logs" / "teacher-router.log").read_text()
    assert f"serving http://{rank['teacher_address']} for 2 replicas" in router_log
    spread = re.search(r"served per replica: \[(\d+), (\d+)\]", router_log)
    assert spread and all(int(n) >= 1 for n in spread.groups()), router_log[-500:]
    for i in (0, 1):   # each replica is a real vLLM server
        assert "vllm" in (tmp_path / "logs" / f"teacher-server-{i}.log").read_text().lower()
    assert_nothing_left(proc.stderr, str(vllm_tiny / "teacher"))


def test_grpo_weights_reach_both_vllm_replicas_behind_the_router_every_step(tmp_path, vllm_tiny):
    proc, rec, address = run_grpo_probe(tmp_path, vllm_tiny, "torchrun", None, gpus=2)
    router_log = (tmp_path / "logs" / "rollout-router.log").read_text()
    assert f"serving http://{address} for 2 replicas" in router_log
    for i in (0, 1):   # one group: the trainer is rank 0 of 3, replica i joins at rank offset i + 1
        log = (tmp_path / "logs" / f"rollout-server-{i}.log").read_text()
        assert f"dualrun gloo weight transfer: rank {i + 1} of 3" in log, log[-2000:]
    assert rec["async_server"]["world_size"] == 2   # the router sums the replicas' world sizes
    assert len(rec["losses"]) == 4
    assert_every_sync_landed(rec, replicas=2)
    spread = re.search(r"served per replica: \[(\d+), (\d+)\]", router_log)
    assert spread and all(int(n) >= 4 * 3 for n in spread.groups()), router_log[-500:]  # 4 syncs x 3 calls each
    assert_nothing_left(proc.stderr, str(tmp_path))
