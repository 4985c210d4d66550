"""Keys that promised what nothing did: each is now honoured or refused with one line, and what is read stays
accepted (the refusals themselves, end to end, are cases of tests/support/bad_inputs.yaml)."""
from __future__ import annotations

from typing import Any

import pytest

from dualrun.config import build_config
from dualrun.contract.errors import ConfigError
from dualrun.methods.plugin import get_plugin


def _validated(raw: dict[str, Any], backend: str | None = None) -> Any:
    cfg = build_config(raw, "c.yaml", backend=backend)
    get_plugin(cfg.method).validate(cfg)
    return cfg


def _refused(raw: dict[str, Any], key: str, backend: str | None = None, **overrides: Any) -> str:
    with pytest.raises(ConfigError) as e:
        cfg = build_config(raw, "c.yaml", overrides, backend=backend)
        get_plugin(cfg.method).validate(cfg)
    assert e.value.key == key and "\n" not in str(e.value) and e.value.exit_code == 2, str(e.value)
    return str(e.value)


@pytest.mark.parametrize("raw,key", [
    ({"backend": "ray", "ray": {"placement_timeout_s": 0}}, "ray.placement_timeout_s"),
    ({"method": "grpo", "roles": {"train": 1, "rollout": {"gpus": 1, "model": "m", "health_timeout_s": 0}}},
     "roles.rollout.health_timeout_s"),
    ({"method": "grpo", "roles": {"train": 1, "rollout": {"gpus": 1, "model": "m", "health_timeout_s": 0.5}}},
     "roles.rollout.health_timeout_s"),
])
def test_timeouts_that_end_before_anything_can_happen_are_refused(raw, key):
    assert "a number >= 1" in _refused(raw, key)


def test_exit_timeout_below_a_second_is_refused():
    from dualrun.config.environment import check_environment

    for value in ("1e-300", "0.5"):
        with pytest.raises(ConfigError, match="DUALRUN_EXIT_TIMEOUT_S: expected a number of seconds in \\[1, "):
            check_environment({"DUALRUN_EXIT_TIMEOUT_S": value})
    check_environment({"DUALRUN_EXIT_TIMEOUT_S": "1"})


def test_null_leaves_a_key_without_a_default_unset():
    cfg = build_config({"collective_timeout_s": None, "torchrun": {"gpus_per_machine": None},
                        "roles": {"train": {"gpus": 2, "top_k": None, "engine": None, "machines": None}}}, "c.yaml")
    assert cfg.collective_timeout_s is None and cfg.torchrun.gpus_per_machine is None
    assert cfg.primary.gpus == 2 and cfg.primary.top_k is None
    _refused({"torchrun": {"monitor_interval": None}}, "torchrun.monitor_interval")   # a default: null is no number


def test_server_args_refuse_a_flag_packed_with_its_value_but_keep_values_with_spaces():
    role = {"gpus": 1, "model": "m"}
    for packed in ("--dtype float32", "--bad word", " --x"):
        line = _refused({"method": "grpo", "roles": {"train": 1, "rollout": {**role, "server_args": [packed]}}},
                        "roles.rollout.server_args[0]")
        assert "a flag and its value as two items" in line
    spaced = ["--hf-overrides", '{"a": 1}', '--override-generation-config={"temperature": 0.5}']
    cfg = _validated({"method": "grpo", "roles": {"train": 1, "rollout": {**role, "server_args": spaced}}})
    assert cfg.role("rollout").server_args == tuple(spaced)


def test_accelerates_rdzv_backend_is_torchruns_rendezvous(tmp_path):
    from dualrun.backends import backend_of
    from dualrun.launchers import Program
    from dualrun.plan.processes import make_plan

    cfg = _validated({"rdzv_backend": "c10d", "num_processes": 2, "use_cpu": True})
    assert cfg.torchrun.rdzv_backend == "c10d"
    launcher = backend_of(cfg).launcher(cfg, Program(str(tmp_path / "job.py"), ()), get_plugin(cfg.method), {})
    argv = list(launcher.prepare(make_plan(cfg)).argv)
    assert argv[argv.index("--rdzv-backend") + 1] == "c10d"
    assert _validated({"rdzv_backend": "static", "torchrun": {"rdzv_backend": "static"}}).torchrun.rdzv_backend \
        == "static"
    assert _validated({"torchrun": {"rdzv_backend": "c10d"}}).torchrun.rdzv_backend == "c10d"
    _refused({"rdzv_backend": "c10d", "torchrun": {"rdzv_backend": "static"}}, "torchrun.rdzv_backend")
    _refused({"rdzv_backend": "etcd"}, "rdzv_backend")


def test_accelerate_launcher_keys_dualrun_lacks_are_refused_and_tpu_keys_stay_inert():
    trl_keys = {"same_network": True, "main_training_function": "main", "tpu_env": [], "tpu_use_cluster": False,
                "tpu_use_sudo": False, "rdzv_backend": "static", "mpirun_config": {}, "commands": [],
                "command_file": None, "tpu_name": None, "tpu_zone": None, "tpu_vm": []}
    assert _validated(trl_keys).num_processes == 1
    assert _validated({"mpirun_config": {"mpirun_hostfile": None}, "use_cpu": True}).num_processes == 1
    _refused({"commands": ["pip install x"]}, "commands")
    _refused({"command_file": "setup.sh"}, "command_file")
    _refused({"mpirun_config": {"mpirun_hostfile": "~/hostfile", "mpirun_ccl": 1}, "use_cpu": True}, "mpirun_config")


def test_gpu_ids_only_where_they_pick_devices():
    _refused({"roles": {"train": {"gpus": 2, "gpu_ids": [0, 1]}}}, "roles.train.gpu_ids", backend="ray")
    _refused({"gpu_ids": "0,1", "num_processes": 2}, "gpu_ids", backend="ray")
    _refused({"use_cpu": True, "roles": {"train": {"gpus": 2, "gpu_ids": [0]}}}, "roles.train.gpu_ids")
    _refused({"distributed_type": "MULTI_CPU", "roles": {"train": {"gpu_ids": [0, 1]}}}, "roles.train.gpu_ids")
    assert _validated({"gpu_ids": "all", "num_processes": 2}, backend="ray").primary.gpu_ids is None
    assert _validated({"roles": {"train": {"gpus": 2, "gpu_ids": [3, 4]}}}).primary.gpu_ids == (3, 4)
    swift = {"method": "sampling", "device_groups": {"nproc_per_node": 4, "a": {
        "device": "GPU", "ranks": "list(range(0, 2))", "workers": ["sampler"]}}}
    on_ray = _validated(swift, backend="ray").role("sampler")   # ms-swift's ranks size the group; Ray places it
    assert on_ray.gpus == 2 and on_ray.gpu_ids is None
    assert _validated(swift).role("sampler").gpu_ids == (0, 1)


def test_ray_refuses_a_machine_rank_and_keeps_num_machines_and_machine_0s_address():
    """A launch as machine 1 on Ray would start a second job; the rest of a torchrun multi-machine file stays valid
    (the same file on both backends: Ray gives the ranks rank 0's address itself)."""
    _refused({"num_machines": 2, "num_processes": 2, "machine_rank": 1}, "machine_rank", backend="ray")
    _refused({"num_machines": 2, "num_processes": 2}, "--machine_rank", backend="ray", machine_rank=1)
    cfg = _validated({"num_machines": 2, "num_processes": 2, "machine_rank": 0, "main_process_port": 1234,
                      "main_process_ip": "10.0.0.1"}, backend="ray")
    assert cfg.num_machines == 2 and cfg.main_process_port == 1234
    assert _validated({"num_machines": 2, "num_processes": 2, "machine_rank": 1, "main_process_ip": "10.0.0.1"}) \
        .machine_rank == 1   # torchrun: one launch per machine, by hand


def test_ray_dry_run_shows_the_main_process_port_rank_0_takes(tmp_path):
    from dualrun.backends import backend_of
    from dualrun.launchers import Program
    from dualrun.plan.processes import AUTO, make_plan

    for port, shown in ((1234, "1234"), (None, AUTO)):
        raw = {"backend": "ray", "use_cpu": True, "num_processes": 2, "main_process_port": port}
        cfg = _validated(raw)
        launcher = backend_of(cfg).launcher(cfg, Program(str(tmp_path / "job.py"), ()), get_plugin(cfg.method), {})
        prepared = launcher.prepare(make_plan(cfg))
        assert all(env["MASTER_PORT"] == shown for env in prepared.rank_envs.values())
        assert f"MASTER_PORT={shown}" in launcher.describe(prepared).replace("'", "")


def test_trainers_with_gpus_0_on_a_gpu_config_are_refused():
    line = _refused({"distributed_type": "MULTI_GPU", "roles": {"train": {"gpus": 0}}}, "roles.train.gpus")
    assert "processes: N" in line
    _refused({"roles": {"train": 0}}, "roles.train.gpus")
    cpu = _validated({"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 2},
                      "roles": {"train": {"gpus": 0, "processes": 2}}})   # configs/sft_zero2_cpu.yaml
    assert cpu.primary.gpus == 0 and cpu.primary.processes == 2
    assert _validated({"use_cpu": True, "roles": {"train": {"gpus": 0}}}).primary.processes == 1
    separate = _validated({"method": "gkd", "roles": {"train": 1, "teacher": {
        "gpus": 0, "model": "m", "top_k": 4, "engine": "transformers"}}})   # a CPU teacher server beside GPU trainers
    assert separate.role("teacher").processes == 1


COLOCATED = {"colocate_groups": [["train", "rollout"]]}
WITH_TEACHER = {"colocate_groups": [["train", "teacher"]]}
SAMPLER = {"gpus": 1, "model": "m", "engine": "vllm"}


@pytest.mark.parametrize("unread,key,read", [
    # the trainers: the script loads their model; no engine, no teacher
    ({"roles": {"train": {"gpus": 2, "top_k": 5}}}, "roles.train.top_k", {"roles": {"train": {"gpus": 2}}}),
    ({"roles": {"train": {"gpus": 2, "model": "m"}}}, "roles.train.model", {"roles": {"train": {"gpus": 2}}}),
    ({"method": "grpo", "roles": {"train": {"gpus": 2, "engine": "vllm"}}}, "roles.train.engine",
     {"method": "grpo", "roles": {"train": 2, "rollout": {"gpus": 2, "engine": "vllm"}}, **COLOCATED}),
    # grpo's rollout: a server takes model and engine, a colocated one only engine (TRL's colocate mode)
    ({"method": "grpo", "roles": {"train": 2, "rollout": {"gpus": 1, "model": "m", "top_k": 3}}},
     "roles.rollout.top_k", {"method": "grpo", "roles": {"train": 2, "rollout": {"gpus": 1, "model": "m",
                                                                                  "engine": "vllm"}}}),
    ({"method": "grpo", "roles": {"train": 2, "rollout": {"gpus": 2, "engine": "vllm", "top_k": 3}}, **COLOCATED},
     "roles.rollout.top_k", {"method": "grpo", "roles": {"train": 2, "rollout": {"gpus": 2, "engine":
                                                                                  "transformers"}}, **COLOCATED}),
    ({"method": "grpo", "roles": {"train": 2, "rollout": {"address": "h:8000", "model": "m"}}}, "roles.rollout.model",
     {"method": "grpo", "roles": {"train": 2, "rollout": {"address": "h:8000"}}}),
    ({"method": "grpo", "roles": {"train": 2, "rollout": {"address": "h:8000", "top_k": 4}}}, "roles.rollout.top_k",
     {"method": "gkd", "roles": {"train": 2, "teacher": {"address": "h:1", "model": "m", "top_k": 4}}}),
    # gkd's teacher: colocated, GKDConfig loads its model (no engine); served, top_k is what it is asked for
    ({"method": "gkd", "roles": {"train": 2, "teacher": {"gpus": 1, "model": "m", "top_k": 4},
                                 "rollout": {"gpus": 1, "model": "m", "top_k": 4}}}, "roles.rollout.top_k",
     {"method": "gkd", "roles": {"train": 2, "teacher": {"gpus": 1, "model": "m", "top_k": 4, "engine": "vllm"},
                                 "rollout": {"gpus": 1, "model": "m"}}}),
    # a role program's groups get model and engine, never top_k
    ({"method": "sampling", "roles": {"sampler": SAMPLER, "prm": {"gpus": 1, "model": "p", "top_k": 3}}},
     "roles.prm.top_k", {"method": "sampling", "roles": {"sampler": SAMPLER, "orm": {"gpus": 1, "model": "r"}}}),
])
def test_role_keys_are_refused_exactly_where_nothing_reads_them(unread, key, read):
    assert "nothing reads it there" in _refused(unread, key)
    _validated(read)


@pytest.mark.parametrize("method,role,spec", [("grpo", "rollout", {"gpus": 2, "engine": "vllm", "model": "m"}),
                                              ("gkd", "teacher", {"gpus": 2, "engine": "vllm", "model": "m",
                                                                  "top_k": 5})])
def test_colocate_groups_alone_switches_a_file_between_separate_and_colocated(method, role, spec):
    """A colocated role keeps the keys its separate server reads (`model`, `engine`): the docs' examples switch
    layouts by the `colocate_groups` line alone."""
    roles = {"train": 2, role: spec}
    assert _validated({"method": method, "roles": roles}).is_separate(role)
    assert not _validated({"method": method, "roles": roles, "colocate_groups": [["train", role]]}).is_separate(role)
