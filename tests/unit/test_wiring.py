"""Plugin hooks fill trainer-config fields the user left at their defaults, never ones they set."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dualrun.config import build_config
from dualrun.plan.processes import make_plan
from dualrun.plugins.workers.grpo_worker import colocate_fields

PROBE = """
import json, os, sys
from dualrun.rank.method import activate
activate(os.environ["DUALRUN_METHOD"])   # what rank/bootstrap.py does: the plugin's worker half
import trl
{body}
"""


def _settings(raw):
    cfg = build_config(raw, "x.yaml")
    return json.loads(make_plan(cfg).env["DUALRUN_SETTINGS"]), make_plan(cfg).env


def test_colocated_vllm_rollout_uses_colocate_mode_and_sleep_mode():
    settings, _ = _settings({"method": "grpo", "offload_model": True,
                             "roles": {"train": {"gpus": 2}, "rollout": {"gpus": 2, "engine": "vllm",
                                                                         "tensor_parallel_size": 2}},
                             "colocate_groups": [["train", "rollout"]]})
    assert colocate_fields(settings) == {"use_vllm": True, "vllm_mode": "colocate", "vllm_tensor_parallel_size": 2,
                                         "vllm_enable_sleep_mode": True}
    plain, _ = _settings({"method": "grpo", "roles": {"train": {"gpus": 2}}})
    assert colocate_fields(plain) == {}


def _probe(env_extra, body, argv=()):
    env = {k: v for k, v in os.environ.items()}
    env.update(env_extra)
    code = PROBE.format(body=body)
    out = subprocess.run([sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_gkd_colocated_teacher_model_from_config_but_user_value_wins(tmp_path):
    _, env = _settings({"method": "gkd", "roles": {"train": {"gpus": 2}, "teacher": {"gpus": 2, "model": "T"}},
                        "colocate_groups": [["train", "teacher"]]})
    env = {k: v for k, v in env.items() if k.startswith("DUALRUN_")}
    body = ("from trl.experimental.gkd import GKDConfig\n"
            "a = GKDConfig(output_dir='{d}', bf16=False)\n"
            "b = GKDConfig(output_dir='{d}', bf16=False, teacher_model_name_or_path='mine')\n"
            "print(json.dumps([a.teacher_model_name_or_path, b.teacher_model_name_or_path]))").format(d=tmp_path)
    assert _probe(env, body) == ["T", "mine"]
