"""Config loading: accelerate keys keep their meaning, dualrun keys are typed, swift's form converts."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

from dualrun.config import build_config, load_config
from dualrun.config import schema
from dualrun.contract.errors import ConfigError
from helpers import REPO

# found, not imported: importing trl at collection costs every test worker a second (transformers with it)
TRL_CONFIGS = sorted((Path(importlib.util.find_spec("trl").origin).parent / "accelerate_configs").glob("*.yaml"))


@pytest.mark.parametrize("path", TRL_CONFIGS, ids=lambda p: p.name)
def test_unmodified_accelerate_configs_are_valid(path):
    cfg = load_config(str(path))
    raw = yaml.safe_load(path.read_text())
    assert cfg.num_processes == raw["num_processes"]
    assert cfg.accelerate["distributed_type"] == raw["distributed_type"]
    assert cfg.primary.name == "train" and cfg.backend == "torchrun" and cfg.method == "sft"


def test_accelerate_key_table_matches_accelerate():
    from accelerate.commands.config.config_args import ClusterConfig

    fields = set(ClusterConfig.__dataclass_fields__)
    ours = set(schema.ACCELERATE_TYPES) - {"fp16", "dynamo_backend"}
    assert fields - ours == set(), "accelerate has keys dualrun does not know"


def test_dualrun_keys_and_defaults():
    cfg = build_config({"backend": "ray", "method": "grpo", "roles": {"train": {"gpus": 4}, "rollout": {"gpus": 2}},
                        "max_failures": 2, "env": {"A": 1, "B": True}, "ray": {"placement_timeout_s": 5}}, "x.yaml")
    assert cfg.backend == "ray" and cfg.method == "grpo" and cfg.max_failures == 2
    assert [r.name for r in cfg.roles] == ["train", "rollout"]
    assert cfg.num_processes == 4 and cfg.accelerate["num_processes"] == 4
    assert cfg.accelerate["distributed_type"] == "MULTI_GPU"
    assert dict(cfg.env) == {"A": "1", "B": "true"}
    assert cfg.ray.placement_timeout_s == 5.0 and cfg.ray.placement_strategy == "PACK"
    assert cfg.is_separate("rollout") and not cfg.is_separate("train")


def test_cli_overrides_win_over_file():
    cfg = build_config({"num_processes": 2, "main_process_port": 1234}, "x.yaml",
                       {"num_processes": 4, "main_process_port": 999, "mixed_precision": "bf16"}, backend="ray")
    assert cfg.num_processes == 4 and cfg.main_process_port == 999 and cfg.backend == "ray"
    assert cfg.accelerate["mixed_precision"] == "bf16"


def test_colocate_groups():
    cfg = build_config({"roles": {"train": {"gpus": 2}, "rollout": {"gpus": 2}},
                        "colocate_groups": [["train", "rollout"]]}, "x.yaml")
    assert cfg.group_of("rollout") == ("train", "rollout") and not cfg.is_separate("rollout")


def test_cpu_roles_count_processes():
    cfg = build_config({"use_cpu": True, "roles": {"train": {"gpus": 2}}}, "x.yaml")
    assert cfg.primary.gpus == 0 and cfg.primary.processes == 2 and cfg.accelerate["distributed_type"] == "MULTI_CPU"


@pytest.mark.parametrize("ranks,ids", [("list(range(0, 2))", (0, 1)), ("list(range(2,4))", (2, 3)),
                                       ([4, 5], (4, 5)), ("6,7", (6, 7))])
def test_swift_device_groups(ranks, ids):
    cfg = build_config({"device_groups": {"nproc_per_node": 8,
                                          "g": {"device": "GPU", "ranks": ranks, "workers": ["sampler"]},
                                          "rm": {"device": "GPU", "ranks": [0, 1] if ids[0] else [2, 3],
                                                 "workers": ["prm", "orm"]}}}, "x.yaml")
    assert cfg.role("sampler").gpu_ids == ids and cfg.role("sampler").gpus == 2
    assert ("prm", "orm") in cfg.colocate_groups


def test_swift_ranks_are_never_evaluated(tmp_path):
    marker = tmp_path / "pwned"
    evil = f"__import__('os').system('touch {marker}')"
    with pytest.raises(ConfigError) as e:
        build_config({"device_groups": {"g": {"device": "GPU", "ranks": evil, "workers": ["train"]}}}, "x.yaml")
    assert "device_groups.g.ranks" in str(e.value)
    assert not marker.exists()


def test_swift_default_worker_is_train():
    cfg = build_config({"device_groups": {"nproc_per_node": 2,
                                          "default": {"device": "GPU", "ranks": 2, "workers": ["default"]}}}, "x.yaml")
    assert cfg.primary.name == "train" and cfg.primary.gpus == 2


def test_load_config_reads_yaml(write):
    path = write("c.yaml", "use_cpu: true\nroles:\n  train: {gpus: 3}\n")
    assert load_config(str(path)).num_processes == 3


def test_config_reference_is_generated_and_current():
    from dualrun.config.reference import render

    doc = (REPO / "docs" / "config-reference.md").read_text()
    assert doc == render(), "run: python -m dualrun.config.reference > docs/config-reference.md"
    for section, keys in schema.SECTIONS.items():
        for key in keys:
            assert f"`{section + '.' if section else ''}{key.name}`" in doc


def test_swift_nproc_per_node_is_honoured():
    groups = {"nproc_per_node": 2, "nnodes": 2,
              "s": {"device": "GPU", "ranks": [2, 3], "workers": ["sampler"]},
              "r": {"device": "GPU", "ranks": "list(range(0, 2))", "workers": ["prm"]}}
    cfg = build_config({"device_groups": groups, "num_machines": 2}, "x.yaml")   # torchrun: nnodes == num_machines
    assert cfg.role("sampler").gpu_ids is None and cfg.role("sampler").gpus == 2   # on node 1: placed by count
    assert cfg.role("prm").gpu_ids == (0, 1)
    span = build_config({"device_groups": {"nproc_per_node": 2, "nnodes": 2,
                                           "s": {"device": "GPU", "ranks": [1, 2], "workers": ["sampler"]}},
                         "backend": "ray"}, "x.yaml")
    assert span.role("sampler").gpus == 2
    with pytest.raises(ConfigError, match="device_groups.nnodes: expected num_machines \\(1\\) on torchrun"):
        build_config({"device_groups": {"nproc_per_node": 2, "nnodes": 2,
                                        "s": {"device": "GPU", "ranks": [1, 2], "workers": ["sampler"]}}}, "x.yaml")
    span = build_config({"device_groups": {"nproc_per_node": 2, "nnodes": 2,
                                           "s": {"device": "GPU", "ranks": [1, 2], "workers": ["sampler"]}},
                         "num_machines": 2}, "x.yaml")
    assert span.role("sampler").gpu_ids is None and span.role("sampler").gpus == 2
    with pytest.raises(ConfigError, match="device_groups.s.ranks.*below nproc_per_node \\* nnodes = 4"):
        build_config({"device_groups": {"nproc_per_node": 4, "s": {"device": "GPU", "ranks": [3, 4],
                                                                    "workers": ["sampler"]}}}, "x.yaml")
