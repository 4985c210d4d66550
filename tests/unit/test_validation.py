"""Every bad input is one ConfigError line naming the file, the key and what was expected."""
from __future__ import annotations

import pytest

from dualrun.config import build_config, load_config
from dualrun.contract.errors import ConfigError
from dualrun.methods.plugin import get_plugin

CASES = [
    ({"nmu_processes": 2}, "nmu_processes", "did you mean 'num_processes'"),
    ({"backend": "kubernetes"}, "backend", "one of torchrun, ray"),
    ({"backend": 3}, "backend", "a string"),
    ({"max_failures": -1}, "max_failures", ">= 0"),
    ({"max_failures": "two"}, "max_failures", "an integer"),
    ({"num_processes": "x"}, "num_processes", "an integer"),
    ({"num_processes": 0}, "num_processes", ">= 1"),
    ({"use_cpu": "maybe"}, "use_cpu", "true or false"),
    ({"mixed_precision": "fp12"}, "mixed_precision", "one of"),
    ({"distributed_type": "MULTI_TPU"}, "distributed_type", "one of"),
    ({"roles": {"train": {"gpus": 2}, "rollout": {"gpus": 1}}, "colocate_groups": [["train", "rollout"]]},
     "colocate_groups[0]", "equal gpus"),
    ({"roles": {"train": {"gpu_ids": [0, 1]}, "teacher": {"gpu_ids": [1, 2]}}}, "roles.teacher.gpu_ids",
     "must not share GPUs"),
    ({"num_processes": 4, "roles": {"train": {"gpus": 2}}}, "num_processes", "roles.train"),
    ({"roles": {"train": {"gpus": 2, "gpuz": 1}}}, "roles.train.gpuz", "did you mean 'gpus'"),
    ({"roles": {"train": {"gpus": -1}}}, "roles.train.gpus", ">= 0"),
    ({"roles": {"train": {"gpus": 2}, "teacher": {}}}, "roles.teacher.gpus", "GPU count"),
    ({"roles": {"train": {"gpus": 2}, "rollout": {"gpus": 3, "tensor_parallel_size": 2}}},
     "roles.rollout.tensor_parallel_size", "divisor"),
    ({"roles": []}, "roles", "mapping"),
    ({"roles": {"train": "many"}}, "roles.train", "mapping"),
    ({"colocate_groups": [["train", "nobody"]]}, "colocate_groups[0]", "names of roles"),
    ({"colocate_groups": "train,rollout"}, "colocate_groups", "list of lists"),
    ({"env": {"A": [1, 2]}}, "env.A", "a string, number or boolean"),
    ({"ray": {"placement_strategy": "RANDOM"}}, "ray.placement_strategy", "one of"),
    ({"ray": {"adress": "auto"}}, "ray.adress", "did you mean 'address'"),
    ({"torchrun": {"rdzv_backend": "etcd"}}, "torchrun.rdzv_backend", "one of"),
    ({"num_machines": 2, "machine_rank": 2}, "machine_rank", "num_machines=2"),
    ({"main_process_port": 70000}, "main_process_port", "port number"),
    ({"num_machines": 2, "num_processes": 3}, "num_processes", "multiple of num_machines"),
    ({"roles": {"train": {"gpus": 2}, "rollout": {"gpus": 1, "address": "no-port"}}}, "roles.rollout.address",
     "host:port"),
    ({"device_groups": {"g": {"device": "TPU", "ranks": [0], "workers": ["train"]}}}, "device_groups.g.device",
     "GPU or CPU"),
    ({"device_groups": {"g": {"device": "GPU", "ranks": "range(2)", "workers": ["train"]}}},
     "device_groups.g.ranks", "device ids"),
    ({"roles": {"train": {"gpus": 1}}, "device_groups": {"g": {"ranks": 1, "workers": ["x"]}}}, "device_groups",
     "not both"),
    # bounds, finite numbers, ports
    ({"roles": {"train": {"gpus": 300_000_000}}}, "roles.train.gpus", "<= 65536"),
    ({"num_processes": 10**11}, "num_processes", "<= 65536"),
    ({"ray": {"placement_timeout_s": float("nan")}}, "ray.placement_timeout_s", "a finite number"),
    ({"ray": {"placement_timeout_s": float("inf")}}, "ray.placement_timeout_s", "a finite number"),
    ({"ray": {"placement_timeout_s": 10**400}}, "ray.placement_timeout_s", "a finite number"),
    ({"main_process_port": 0}, "main_process_port", "[1, 65535]"),
    ({"device_groups": {"g": {"ranks": "list(range(0, 4, 0))", "workers": ["train"]}}}, "device_groups.g.ranks",
     "step other than 0"),
    ({"device_groups": {"g": {"ranks": "list(range(0, 10**12))", "workers": ["train"]}}}, "device_groups.g.ranks",
     "device ids like"),
    ({"device_groups": {"g": {"ranks": "list(range(0, 1000000000000))", "workers": ["train"]}}},
     "device_groups.g.ranks", "device ids in [0, 1023]"),
    ({"device_groups": {"nproc_per_node": 2, "g": {"ranks": [1, 2], "workers": ["train"]}}},
     "device_groups.g.ranks", "below nproc_per_node * nnodes = 2"),
    # values that would put ranks on the wrong GPUs or address
    ({"env": {"RANK": 1}}, "env.RANK", "does not set itself"),
    ({"roles": {"train": {"gpus": 1, "env": {"CUDA_VISIBLE_DEVICES": "1"}}}}, "roles.train.env.CUDA_VISIBLE_DEVICES",
     "does not set itself"),
    ({"env": {"OK": {1, 2}}}, "env.OK", "a string, number or boolean"),
    ({"num_machines": 2, "num_processes": 2, "machine_rank": 1}, "main_process_ip", "address of machine 0"),
    ({"gpu_ids": "0", "num_processes": 2}, "gpu_ids", "at least 2 ids"),
    ({"ray": {"address": "ray://u:p@h:1"}}, "ray.address", "HOST:PORT"),
    ({"use_cpu": True, "method": "grpo", "roles": {"train": {"gpus": 2}, "rollout": {"gpus": 2, "engine": "vllm"}},
      "colocate_groups": [["train", "rollout"]]}, "roles.rollout.engine", "separate vLLM server"),
]


@pytest.mark.parametrize("raw,key,expected", CASES, ids=[c[1] + f"-{i}" for i, c in enumerate(CASES)])
def test_bad_config_names_key(raw, key, expected):
    with pytest.raises(ConfigError) as e:
        build_config(raw, "bad.yaml")
    line = str(e.value)
    assert "\n" not in line
    assert line.startswith("bad.yaml: ") or line.startswith("<command line>: ")
    assert f": {key}:" in line, line
    assert expected in line, line
    assert e.value.exit_code == 2


@pytest.mark.parametrize("text,key", [("a: [1, 2\n", "<yaml>"), ("- just\n- a list\n", "<top level>"),
                                      ("roles:\n\ttrain: 1\n", "<yaml>")])
def test_bad_files(write, text, key):
    with pytest.raises(ConfigError) as e:
        load_config(str(write("bad.yaml", text)))
    assert f": {key}:" in str(e.value)


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="config_file: expected an existing file"):
        load_config(str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError, match="config_file: expected a YAML file"):
        load_config(str(tmp_path))
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="config_file"):
        load_config(str(binary))


def test_unknown_method_and_roles():
    cfg = build_config({"method": "ppo"}, "m.yaml")
    with pytest.raises(ConfigError, match="m.yaml: method: expected one of .*sft"):
        get_plugin(cfg.method, cfg.source)
    cfg = build_config({"roles": {"train": {"gpus": 1}, "critic": {"gpus": 1}}}, "m.yaml")
    with pytest.raises(ConfigError, match="roles.critic"):
        get_plugin("sft").validate(cfg)


def test_a_separate_vllm_on_cpu_and_a_multi_node_rank_0_stay_valid():
    build_config({"use_cpu": True, "method": "grpo", "roles": {"train": {"gpus": 2}, "rollout": {"gpus": 1,
                  "engine": "vllm", "model": "m"}}}, "ok.yaml")
    build_config({"num_machines": 2, "num_processes": 2, "machine_rank": 0}, "ok.yaml")
    build_config({"num_machines": 2, "num_processes": 2, "machine_rank": 0, "backend": "ray"}, "ok.yaml")
    build_config({"env": {"OMP_NUM_THREADS": 4, "MY_RANK_NAME": "x"}}, "ok.yaml")


def test_log_dir_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match="log_dir: expected a directory"):
        build_config({"log_dir": str(tmp_path / "f")}, "bad.yaml")
    build_config({"log_dir": str(tmp_path / "new")}, "ok.yaml")


def test_empty_file_is_an_error_but_no_file_keeps_the_defaults(write):
    with pytest.raises(ConfigError, match="<top level>: expected a mapping.*an empty file"):
        load_config(str(write("empty.yaml", "")))
    assert load_config(None).num_processes == 1
