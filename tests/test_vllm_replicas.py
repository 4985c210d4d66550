"""Two real vLLM CPU engines behind dualrun's router serve a GKD teacher: `teacher: {gpus: 2, engine: vllm}` on CPU
is two replicas (one vLLM engine per process), the unchanged GKDTrainer distils from the router's one address for
a few steps, both replicas answer scoring requests, and everything is stopped with nothing left behind."""
from __future__ import annotations

import re

import pytest

from vllm_helpers import TIER, assert_nothing_left, run_gkd_probe, server_role

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
