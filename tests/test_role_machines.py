"""`roles.<name>.machines`: read, refused where it cannot hold, and obeyed by the plan."""
from __future__ import annotations

import pytest

from dualrun.config import build_config
from dualrun.contract.errors import ConfigError
from dualrun.plan.processes import make_plan

TWO = {"num_machines": 2, "machine_rank": 0, "main_process_ip": "10.0.0.1", "main_process_port": 29500}


def _cfg(rollout: dict, **top):
    return build_config({**TWO, "method": "grpo", "roles": {"train": {"gpus": 2}, "rollout": rollout}, **top},
                        "x.yaml")


def test_gpu_servers_go_to_the_machines_listed():
    plan = make_plan(_cfg({"gpus": 2, "machines": [1]}, torchrun={"gpus_per_machine": 4}))
    assert [p.node for p in plan.workers] == [0, 1]
    assert [(p.node, p.devices) for p in plan.servers if p.kind == "server"] == [(1, (1,)), (1, (2,))]


def test_without_machines_the_servers_fill_machine_0_first():
    plan = make_plan(_cfg({"gpus": 2}, torchrun={"gpus_per_machine": 4}))
    assert [p.node for p in plan.servers if p.kind == "server"] == [0, 0]


def test_assumed_cluster_holds_the_servers_on_their_first_machine():
    plan = make_plan(_cfg({"gpus": 2, "tensor_parallel_size": 2, "machines": [1]}))
    assert [n.gpus for n in plan.cluster.nodes] == [1, 3]
    assert [(p.node, p.devices) for p in plan.servers] == [(1, (1, 2))]
    assert "node 1" in plan.table() and "rollout server 0" in plan.table()


def test_the_list_order_is_the_order_tried():
    plan = make_plan(_cfg({"gpus": 4, "machines": [1, 0]}, torchrun={"gpus_per_machine": 3}))
    assert [p.node for p in plan.servers if p.kind == "server"] == [1, 1, 0, 0]


def test_cpu_server_role_goes_to_its_machine():
    cfg = build_config({**TWO, "use_cpu": True, "method": "gkd",
                        "roles": {"train": {"gpus": 2}, "teacher": {"processes": 1, "engine": "transformers",
                                                                    "model": "m", "top_k": 4, "machines": [1]}}},
                       "x.yaml")
    plan = make_plan(cfg)
    assert [(p.unit, p.node) for p in plan.servers] == [("teacher", 1)]


def test_no_room_on_the_machines_listed_is_one_line():
    with pytest.raises(ConfigError, match="roles.rollout.gpus"):
        make_plan(_cfg({"gpus": 4, "machines": [1]}, torchrun={"gpus_per_machine": 3}))


@pytest.mark.parametrize("rollout,top,key,what", [
    ({"gpus": 1, "machines": [2]}, {}, "roles.rollout.machines", "0..1"),
    ({"gpus": 1, "machines": [1, 1]}, {}, "roles.rollout.machines", "written twice"),
    ({"gpus": 1, "machines": []}, {}, "roles.rollout.machines", "non-empty list"),
    ({"gpus": 1, "machines": 1}, {}, "roles.rollout.machines", "non-empty list"),
    ({"gpus": 1, "machines": ["1"]}, {}, "roles.rollout.machines", "non-empty list"),
    ({"gpus": 1, "machines": [True]}, {}, "roles.rollout.machines", "non-empty list"),
    ({"gpus": 1, "machines": [1]}, {"backend": "ray"}, "roles.rollout.machines", "Ray"),
    ({"address": "h:1", "machines": [1]}, {}, "roles.rollout.machines", "address"),
    ({"gpus": 1, "gpu_ids": [3], "machines": [1]}, {}, "roles.rollout.machines", "gpu_ids"),
    ({"gpus": 2, "machines": [1]}, {"colocate_groups": [["train", "rollout"]]}, "roles.rollout.machines",
     "separate server role"),
])
def test_refused_with_one_line(rollout, top, key, what):
    with pytest.raises(ConfigError) as e:
        _cfg(rollout, **top)
    line = str(e.value)
    assert key in line and what in line and "\n" not in line


def test_refused_on_the_trainers():
    with pytest.raises(ConfigError, match="roles.train.machines.*separate server role"):
        build_config({**TWO, "roles": {"train": {"gpus": 2, "machines": [0]}}}, "x.yaml")


def test_plan_command_shows_the_machine_and_refuses_a_bad_one_with_exit_2(tmp_path):
    from helpers import dualrun

    job = tmp_path / "job.yaml"
    job.write_text("use_cpu: true\nmethod: gkd\nroles:\n  train: {gpus: 2}\n"
                   "  teacher: {gpus: 1, model: m, top_k: 4, machines: [1]}\n")
    flags = ["--num_machines", "2", "--main_process_ip", "10.0.0.1"]
    shown = dualrun("plan", "--config_file", str(job), *flags, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.split("node 1 ")[1].count("teacher server 0") == 1
    (tmp_path / "t.py").write_text("")
    for k, starts in ((0, False), (1, True)):   # each machine's dry run: only machine 1 starts the teacher
        dry = dualrun("launch", "--dry_run", "--config_file", str(job), *flags, "--machine_rank", str(k), "t.py",
                      cwd=tmp_path)
        assert dry.returncode == 0, dry.stderr
        assert ("# teacher server 0, started first:" in dry.stdout) == starts, (k, dry.stdout)
        assert ("--host 0.0.0.0" in dry.stdout) == starts and "--host 127.0.0.1" not in dry.stdout, dry.stdout
    job.write_text(job.read_text().replace("[1]", "[1, 2]"))
    bad = dualrun("plan", "--config_file", str(job), *flags, cwd=tmp_path)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().count("\n") == 0 and "roles.teacher.machines" in bad.stderr, bad.stderr
