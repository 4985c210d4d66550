"""Two real vLLM CPU engines behind dualrun's router serve a GKD teacher: `teacher: {gpus: 2, engine: vllm}` on CPU
is two replicas (one vLLM engine per process), the unchanged GKDTrainer distils from the router's one address for
a few steps, both replicas answer scoring requests, and everything is stopped with nothing left behind."""
from __future__ import annotations

import json
import re

import pytest

from conftest import dualrun
from ray_helpers import ray_env
from vllm_helpers import ASSETS, SERVER_ARGS, SERVER_ENV, TIER, assert_nothing_left, tiny_vllm

pytestmark = [*TIER, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_vllm(tmp_path_factory)


def test_gkd_distils_from_two_vllm_replicas_behind_the_router(tmp_path, tiny):
    (tmp_path / "job.yaml").write_text(
        "use_cpu: true\nmethod: gkd\nlog_dir: logs\nroles:\n  train: {gpus: 1}\n"
        f"  teacher: {{gpus: 2, engine: vllm, model: {tiny / 'teacher'}, top_k: 5, health_timeout_s: 400, "
        f"server_args: {SERVER_ARGS}, env: {SERVER_ENV}}}\n")
    (tmp_path / "out").mkdir()
    proc = dualrun("launch", "--config_file", "job.yaml", str(ASSETS / "gkd_probe.py"),
                   "--model_name_or_path", str(tiny / "model"), "--teacher_model_name_or_path", str(tiny / "teacher"),
                   "--data", str(tiny / "data" / "gkd.jsonl"), "--output_dir", "out", "--max_steps", "2",
                   cwd=tmp_path, env=ray_env(TRL_EXPERIMENTAL_SILENCE="1"), timeout=580)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rank = json.loads((tmp_path / "out" / "rank0.json").read_text())
    assert rank["teacher"] == "RemoteTeacher" and len(rank["losses"]) == 2
    assert all(x == x and x >= 0 for x in rank["losses"])
    router_log = (tmp_path / "logs" / "teacher-router.log").read_text()
    assert f"serving http://{rank['teacher_address']} for 2 replicas" in router_log
    spread = re.search(r"served per replica: \[(\d+), (\d+)\]", router_log)
    assert spread and all(int(n) >= 1 for n in spread.groups()), router_log[-500:]
    for i in (0, 1):   # each replica is a real vLLM server
        assert "vllm" in (tmp_path / "logs" / f"teacher-server-{i}.log").read_text().lower()
    assert_nothing_left(proc.stderr, str(tiny / "teacher"))
