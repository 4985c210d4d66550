"""The plan is pure and fast; it places every process and gives each its env."""
from __future__ import annotations

import json
import time

import pytest

from dualrun.config import build_config
from dualrun.env.worker import TORCHRUN_NAMES
from dualrun.contract.errors import ConfigError
from dualrun.plan.processes import Cluster, make_plan


def test_torchrun_single_node_gpu_layout():
    cfg = build_config({"roles": {"train": {"gpus": 4}, "rollout": {"gpus": 2, "tensor_parallel_size": 2},
                                  "teacher": {"gpus": 2, "tensor_parallel_size": 2}}}, "x.yaml")
    plan = make_plan(cfg)
    workers = plan.workers
    assert [p.devices for p in workers] == [(0,), (1,), (2,), (3,)]
    assert [p.local_rank for p in workers] == [0, 1, 2, 3]
    assert all(p.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" for p in workers)
    assert {s.unit: s.devices for s in plan.servers} == {"rollout": (4, 5), "teacher": (6, 7)}
    assert plan.servers[0].env["CUDA_VISIBLE_DEVICES"] == "4,5"


def test_ray_workers_see_one_gpu_and_local_rank_zero():
    cfg = build_config({"backend": "ray", "roles": {"train": {"gpus": 4}}}, "x.yaml")
    plan = make_plan(cfg, Cluster.uniform(2, 2))
    assert [(p.node, p.devices) for p in plan.workers] == [(0, (0,)), (0, (1,)), (1, (0,)), (1, (1,))]
    assert {p.env["LOCAL_RANK"] for p in plan.workers} == {"0"}
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plan.workers] == ["0", "1", "0", "1"]
    assert [p.env["NODE_RANK"] for p in plan.workers] == ["0", "0", "1", "1"]
    assert [p.env["RANK"] for p in plan.workers] == ["0", "1", "2", "3"]


def test_worker_env_has_torchrun_names_on_both_backends():
    for backend in ("torchrun", "ray"):
        cfg = build_config({"backend": backend, "use_cpu": True, "roles": {"train": {"gpus": 2}}}, "x.yaml")
        for p in make_plan(cfg).workers:
            assert set(TORCHRUN_NAMES) <= set(p.env)
            assert p.env["WORLD_SIZE"] == "2" and p.devices == ()


def test_colocated_roles_share_the_trainer_processes():
    cfg = build_config({"roles": {"train": {"gpus": 2}, "rollout": {"gpus": 2}},
                        "colocate_groups": [["train", "rollout"]]}, "x.yaml")
    plan = make_plan(cfg)
    assert len(plan.processes) == 2 and plan.servers == ()
    assert plan.workers[0].unit == "train+rollout" and plan.workers[0].env["DUALRUN_ROLES"] == "train,rollout"


def test_multi_node_torchrun_splits_ranks():
    cfg = build_config({"num_machines": 2, "machine_rank": 1, "main_process_ip": "10.0.0.1",
                        "roles": {"train": {"gpus": 4}}}, "x.yaml")
    plan = make_plan(cfg)
    assert [p.node for p in plan.workers] == [0, 0, 1, 1]
    assert [p.local_rank for p in plan.workers] == [0, 1, 0, 1]
    assert plan.workers[2].env["MASTER_ADDR"] == "10.0.0.1" and plan.machine_rank == 1


def test_external_server_is_not_started():
    cfg = build_config({"method": "grpo", "roles": {"train": {"gpus": 2},
                                                    "rollout": {"address": "host:8000"}}}, "x.yaml")
    plan = make_plan(cfg)
    assert plan.servers == () and dict(plan.external) == {"rollout": "host:8000"}


def test_too_many_gpus_is_a_config_error():
    cfg = build_config({"backend": "ray", "roles": {"train": {"gpus": 5}}}, "x.yaml")
    with pytest.raises(ConfigError, match="roles.train.gpus: expected at most 4 GPUs"):
        make_plan(cfg, Cluster.uniform(2, 2))


def test_secrets_are_redacted_in_json():
    cfg = build_config({"env": {"HF_TOKEN": "hf_abc", "WANDB_API_KEY": "k", "MY_SECRET": "s", "OK": "v"}}, "x.yaml")
    data = json.loads(make_plan(cfg).to_json())
    env = data["processes"][0]["env"]
    assert env["HF_TOKEN"] == env["WANDB_API_KEY"] == env["MY_SECRET"] == "***" and env["OK"] == "v"
    assert "hf_abc" not in make_plan(cfg).to_json()


def test_plans_1024_gpus_on_128_nodes_fast():
    cfg = build_config({"backend": "ray", "roles": {"train": {"gpus": 1008}, "rollout": {"gpus": 8},
                                                    "teacher": {"gpus": 8, "tensor_parallel_size": 8}}}, "big.yaml")
    start = time.process_time()   # CPU time: the planner's own cost, whatever else loads the machine
    plan = make_plan(cfg, Cluster.uniform(128, 8))
    text = plan.to_json()
    elapsed = time.process_time() - start
    assert len(plan.workers) == 1008 and len(plan.servers) == 8 + 1 + 1   # 8 rollout replicas, their router
    assert len({p.node for p in plan.processes}) == 128 and len(text) > 0
    assert elapsed < 1.0, elapsed


def test_table_names_every_process():
    cfg = build_config({"roles": {"train": {"gpus": 2}, "teacher": {"gpus": 1}}, "method": "gkd"}, "x.yaml")
    table = make_plan(cfg).table()
    assert "GPU 0        train rank 0" in table and "GPU 2        teacher server 0" in table


def _cpu_gkd(slots: int, teacher: int) -> dict:
    return {"use_cpu": True, "method": "gkd", "torchrun": {"gpus_per_machine": slots},
            "roles": {"train": {"gpus": 2}, "teacher": {"gpus": teacher, "model": "m/t", "top_k": 5}}}


def test_a_cpu_plan_counts_process_slots_not_gpus():
    table = make_plan(build_config(_cpu_gkd(3, 1), "x.yaml")).table()
    assert "node 0 127.0.0.1 (this machine): 3 process slot(s)" in table and "GPU" not in table
    gpu = make_plan(build_config({"roles": {"train": {"gpus": 2}}, "torchrun": {"gpus_per_machine": 4}}, "g.yaml"))
    assert "node 0 127.0.0.1 (this machine): 4 GPU(s)" in gpu.table()


@pytest.mark.parametrize("teacher, expected", [
    (1, "expected at most 0 free process slots (torchrun.gpus_per_machine) on one node for a separate role, got 1"),
    (2, "expected 1 free process slots (torchrun.gpus_per_machine) on one node for each of its 2 engines (engine 0 "
        "finds at most 0), got 2")])
def test_a_cpu_role_too_big_for_its_slots_shows_the_count_asked(teacher, expected):
    with pytest.raises(ConfigError) as refused:
        make_plan(build_config(_cpu_gkd(2, teacher), "x.yaml"))
    assert str(refused.value) == f"x.yaml: roles.teacher.gpus: {expected}"
