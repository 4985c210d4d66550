"""Config keys do what they say or are refused with what to use instead: `offload_optimizer` becomes accelerate's
DeepSpeed `offload_optimizer_device`, `sleep_level` / `offload_teacher_model` are refused, and GKDTrainer refuses
a rollout server it would never ask."""
from __future__ import annotations

import pytest

from helpers import dualrun
from dualrun.launchers.accelerate_env import accelerate_env
from dualrun.config import build_config
from dualrun.config.schema import REFUSED
from dualrun.contract.errors import ConfigError

ZERO2 = {"distributed_type": "DEEPSPEED", "num_processes": 2,
         "deepspeed_config": {"zero_stage": 2, "offload_param_device": "none"}}


def test_offload_optimizer_sets_deepspeeds_offload_device():
    cfg = build_config({**ZERO2, "offload_optimizer": True}, "ds.yaml")
    assert cfg.accelerate["deepspeed_config"]["offload_optimizer_device"] == "cpu"
    env = accelerate_env(cfg, environ={})
    assert env["ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"] == "cpu"
    nvme = build_config({**ZERO2, "offload_optimizer": True,
                         "deepspeed_config": {"zero_stage": 2, "offload_optimizer_device": "nvme"}}, "ds.yaml")
    assert nvme.accelerate["deepspeed_config"]["offload_optimizer_device"] == "nvme"  # the user's device wins
    plain = build_config(ZERO2, "ds.yaml")
    assert "offload_optimizer_device" not in plain.accelerate["deepspeed_config"]


def test_offload_optimizer_turns_trls_none_into_cpu():
    """TRL's zero2.yaml (and configs/sft_zero2_cpu.yaml) write `offload_optimizer_device: none`: not offloaded yet,
    so `offload_optimizer: true` offloads, as the key's doc says; the parameter device stays the file's."""
    raw = {**ZERO2, "offload_optimizer": True, "deepspeed_config": {
        "zero_stage": 2, "offload_optimizer_device": "none", "offload_param_device": "none"}}
    ds = build_config(raw, "zero2.yaml").accelerate["deepspeed_config"]
    assert ds["offload_optimizer_device"] == "cpu" and ds["offload_param_device"] == "none"
    assert build_config({**raw, "offload_optimizer": False}, "z.yaml").accelerate["deepspeed_config"][
        "offload_optimizer_device"] == "none"
    for stage in (1, 3):
        raw["deepspeed_config"]["zero_stage"] = stage
        assert build_config(raw, "z.yaml").accelerate["deepspeed_config"]["offload_optimizer_device"] == "cpu"


@pytest.mark.parametrize("raw,key,text", [
    ({"offload_optimizer": True}, "offload_optimizer", "distributed_type: DEEPSPEED"),
    ({**ZERO2, "offload_optimizer": True, "deepspeed_config": {"zero_stage": 0}},
     "deepspeed_config.zero_stage", "stage 0 partitions nothing"),
    ({**ZERO2, "offload_optimizer": True, "deepspeed_config": {"zero_stage": "0", "offload_optimizer_device": "cpu"}},
     "deepspeed_config.zero_stage", "ZeRO stage 1, 2 or 3"),
    ({**ZERO2, "offload_optimizer": True, "deepspeed_config": {"deepspeed_config_file": "ds.json"}},
     "offload_optimizer", "DeepSpeed JSON file"),
    ({"sleep_level": 2}, "sleep_level", "level 2"),
    ({"offload_teacher_model": True}, "offload_teacher_model", "roles.teacher"),
])
def test_keys_without_an_effect_are_refused(raw, key, text):
    with pytest.raises(ConfigError) as e:
        build_config(raw, "x.yaml")
    assert e.value.key == key and text in str(e.value)


def test_refused_key_is_one_line_and_exit_code_2(tmp_path):
    (tmp_path / "c.yaml").write_text("method: grpo\nsleep_level: 1\n")
    proc = dualrun("plan", "--config_file", "c.yaml", cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "c.yaml: sleep_level" in lines[0] and "Traceback" not in proc.stderr
    assert set(REFUSED) == {"sleep_level", "offload_teacher_model"}


@pytest.mark.slow
def test_gkd_trainer_refuses_a_rollout_server_it_never_reads():
    from trl.experimental.gkd import GKDTrainer

    from dualrun.plugins.workers.gkd_worker import ROLLOUT_UNREAD, refuse_rollout_server

    class Trainer(GKDTrainer):  # a subclass: the real class stays untouched for other tests
        pass

    refuse_rollout_server(Trainer)
    refuse_rollout_server(Trainer)  # idempotent
    with pytest.raises(ValueError, match="never reads it") as e:
        Trainer(model=None)
    assert str(e.value) == ROLLOUT_UNREAD and "DistillationTrainer" in ROLLOUT_UNREAD


def test_use_ray_is_accepted_as_docs_migration_says():
    assert build_config({"use_ray": True}, "s.yaml").backend == "ray"
    assert build_config({"use_ray": True, "backend": "torchrun"}, "s.yaml").backend == "torchrun"
    assert build_config({"use_ray": True}, "s.yaml", backend="torchrun").backend == "torchrun"
