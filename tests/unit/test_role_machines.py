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
     "holding machine 0"),
])
def test_refused_with_one_line(rollout, top, key, what):
    with pytest.raises(ConfigError) as e:
        _cfg(rollout, **top)
    line = str(e.value)
    assert key in line and what in line and "\n" not in line


def _served(train: dict, teacher: dict | None = None, **top):
    """GKD with the trainers' `machines` given: by default both ranks on machine 0, the teacher alone on machine 1."""
    teacher = {"processes": 1, "engine": "transformers", "model": "m", "top_k": 4, "machines": [1]} \
        if teacher is None else teacher
    return build_config({**TWO, "use_cpu": True, "method": "gkd", "roles": {"train": train, "teacher": teacher},
                         **top}, "x.yaml")


def test_trainers_on_machine_0_and_a_machine_that_only_serves():
    plan = make_plan(_served({"gpus": 2, "machines": [0]}))
    assert [(p.label, p.node, p.env["NODE_RANK"], p.env["GROUP_WORLD_SIZE"]) for p in plan.workers] == [
        ("train rank 0", 0, "0", "1"), ("train rank 1", 0, "0", "1")]
    assert [(p.unit, p.node) for p in plan.servers] == [("teacher", 1)]
    machine_1 = plan.table().split("node 1 ")[1]
    assert machine_1.splitlines()[1] == "  no ranks: this machine runs only the servers below"
    assert "teacher server 0" in machine_1 and "train rank" not in machine_1


def test_the_trainers_machines_share_the_ranks_evenly_and_skip_a_serving_machine():
    cfg = _served({"gpus": 4, "machines": [2, 0]}, num_machines=3)
    plan = make_plan(cfg)
    assert cfg.trainer_machines == (0, 2)
    assert [(p.rank, p.node, p.env["NODE_RANK"]) for p in plan.workers] == [(0, 0, "0"), (1, 0, "0"), (2, 2, "1"),
                                                                            (3, 2, "1")]
    assert [p.node for p in plan.servers] == [1]


def test_assumed_gpus_put_no_trainer_gpu_on_a_serving_machine():
    cfg = build_config({**TWO, "method": "grpo", "roles": {"train": {"gpus": 2, "machines": [0]},
                                                           "rollout": {"gpus": 1, "machines": [1]}}}, "x.yaml")
    plan = make_plan(cfg)
    assert [n.gpus for n in plan.cluster.nodes] == [2, 1]
    assert [(p.node, p.devices) for p in plan.workers] == [(0, (0,)), (0, (1,))]
    assert [(p.node, p.devices) for p in plan.servers] == [(1, (0,))]


def test_a_colocated_role_shares_the_trainers_machines():
    cfg = build_config({**TWO, "method": "grpo", "colocate_groups": [["train", "rollout"]],
                        "roles": {"train": {"gpus": 2}, "rollout": {"gpus": 2, "machines": [0, 1]}}}, "x.yaml")
    assert cfg.trainer_machines == (0, 1)


@pytest.mark.parametrize("train,top,key,what", [
    ({"gpus": 2, "machines": [1]}, {}, "roles.train.machines", "holding machine 0"),
    ({"gpus": 3, "machines": [0, 1]}, {}, "roles.train.machines", "evenly"),
    ({"gpus": 2, "machines": [0, 2]}, {}, "roles.train.machines", "0..1"),
    ({"gpus": 2, "machines": [0]}, {"num_machines": 3}, "roles.train.machines", "machine 2 runs neither"),
    ({"gpus": 2, "machines": [0]}, {"backend": "ray"}, "roles.train.machines", "Ray"),
])
def test_trainers_machines_refused_with_one_line(train, top, key, what):
    with pytest.raises(ConfigError) as e:
        _served(train, **top)
    line = str(e.value)
    assert key in line and what in line and "\n" not in line, line


def test_colocated_roles_that_disagree_on_machines_are_refused():
    with pytest.raises(ConfigError, match=r"roles.rollout.machines: .*roles.train.machines, \[0\]"):
        build_config({**TWO, "method": "grpo", "colocate_groups": [["train", "rollout"]],
                      "roles": {"train": {"gpus": 2, "machines": [0]}, "rollout": {"gpus": 2, "machines": [0, 1]}}},
                     "x.yaml")


def test_a_machine_the_servers_leave_idle_is_refused_by_the_plan():
    cfg = _served({"gpus": 2, "machines": [0]}, {"processes": 1, "engine": "transformers", "model": "m", "top_k": 4},
                  torchrun={"gpus_per_machine": 3})
    with pytest.raises(ConfigError, match=r"roles.train.machines: .*machine 1 gets neither"):
        make_plan(cfg)


def test_torchruns_nodes_are_the_machines_with_ranks(tmp_path):
    from dualrun.launchers.launcher import Program
    from dualrun.backends.torchrun.agent_launcher import TorchrunLauncher

    argv = {}
    for k in (0, 1, 2):
        cfg = build_config({**TWO, "num_machines": 3, "machine_rank": k, "use_cpu": True, "method": "gkd",
                            "roles": {"train": {"gpus": 4, "machines": [0, 2]},
                                      "teacher": {"processes": 1, "engine": "transformers", "model": "m", "top_k": 4,
                                                  "machines": [1]}}}, "x.yaml")
        launcher = TorchrunLauncher(cfg, Program("t.py"))
        plan = make_plan(cfg)
        argv[k] = launcher.torchrun_argv(plan) if not launcher.serves_only(plan) else None
    assert argv[1] is None
    for k, rank in ((0, "0"), (2, "1")):
        flags = dict(zip(argv[k][:12:2], argv[k][1:12:2]))
        assert (flags["--nnodes"], flags["--node-rank"], flags["--nproc-per-node"]) == ("2", rank, "2"), argv[k]


def test_the_serving_machines_dry_run_starts_no_agent(tmp_path):
    from helpers import dualrun

    job = tmp_path / "job.yaml"
    job.write_text("use_cpu: true\nmethod: gkd\nroles:\n  train: {gpus: 2, machines: [0]}\n"
                   "  teacher: {gpus: 1, model: m, top_k: 4, machines: [1]}\n")
    (tmp_path / "t.py").write_text("")
    flags = ["--config_file", str(job), "--num_machines", "2", "--main_process_ip", "10.0.0.1"]
    dry = [dualrun("launch", "--dry_run", *flags, "--machine_rank", str(k), "t.py", cwd=tmp_path) for k in (0, 1)]
    assert [d.returncode for d in dry] == [0, 0], [d.stderr for d in dry]
    assert "--nnodes 1 --nproc-per-node 2 --node-rank 0 --master-addr 10.0.0.1" in dry[0].stdout
    assert "torch.distributed.run" not in dry[1].stdout
    assert "# teacher server 0, started beside the trainers:" in dry[1].stdout
    assert "# machine 1 runs no ranks and no torchrun agent: it serves, hands its servers' addresses to machine 0's " \
           "store at 10.0.0.1:29500 and ends when machine 0's ranks end" in dry[1].stdout
    for d in dry:
        assert "node 1 node1" in d.stdout and "no ranks: this machine runs only the servers below" in d.stdout


def test_a_held_store_listens_past_its_creator(tmp_path):
    """torchrun's agent drops its store when it returns; held, it keeps listening until the holder lets go."""
    import gc
    from datetime import timedelta

    import torch.distributed as dist

    from dualrun.contract.job_store import listening
    from dualrun.light.held_stores import held_stores

    def agent() -> int:
        return dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=5), wait_for_workers=False).port   # as torch's

    with held_stores() as held:
        port = agent()
    assert len(held) == 1 and listening("127.0.0.1", port)
    held.clear()
    gc.collect()
    assert not listening("127.0.0.1", port)
    assert agent() and not held   # outside, nothing is held


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
        assert ("# teacher server 0, started beside the trainers:" in dry.stdout) == starts, (k, dry.stdout)
        assert ("--host 0.0.0.0" in dry.stdout) == starts and "--host 127.0.0.1" not in dry.stdout, dry.stdout
    job.write_text(job.read_text().replace("[1]", "[1, 2]"))
    bad = dualrun("plan", "--config_file", str(job), *flags, cwd=tmp_path)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().count("\n") == 0 and "roles.teacher.machines" in bad.stderr, bad.stderr


def test_the_recipes_serving_layout_plans_as_it_says(tmp_path):
    """examples/multi-node/torchrun-by-hand: its YAML with the trainers on machine 0 and the rollout on machine 1."""
    from helpers import REPO, dualrun
    from doc_recipes import doc_blocks

    doc = REPO / "examples" / "multi-node" / "torchrun-by-hand" / "README.md"
    (tmp_path / "grpo_two_nodes.yaml").write_text(next(b for b in doc_blocks(doc, "yaml") if "machines: [0]" in b))
    shown = dualrun("plan", "--config_file", "grpo_two_nodes.yaml", "--main_process_ip", "10.0.0.1", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    machine_0, machine_1 = shown.stdout.split("node 1 ")
    assert machine_0.count("train rank") == 2 and "rollout" not in machine_0
    assert "no ranks: this machine runs only the servers below" in machine_1 and "rollout server 0" in machine_1
