"""One placement policy per backend, and the launching shell's environment as a value the plan is given."""
from __future__ import annotations

from dualrun.config import build_config
from dualrun.backends.ray.packing import RayPlacement
from dualrun.plan.placement import MachinesPlacement, placement_for
from dualrun.plan.processes import make_plan

GPU2 = {"roles": {"train": {"gpus": 2}}}


def _devices(plan) -> list[tuple[int, ...]]:
    return [p.devices for p in plan.workers]


def test_the_backend_name_picks_the_policy():
    assert isinstance(placement_for(build_config(GPU2, "t.yaml")), MachinesPlacement)
    assert isinstance(placement_for(build_config({**GPU2, "backend": "ray"}, "r.yaml")), RayPlacement)


def test_the_plan_reads_the_shells_gpus_only_from_what_it_is_given(monkeypatch):
    cfg = build_config(GPU2, "t.yaml")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7")   # the process's own environment: not the plan's input
    assert _devices(make_plan(cfg)) == [(0,), (1,)]
    assert _devices(make_plan(cfg, environ={"CUDA_VISIBLE_DEVICES": "3,4"})) == [(3,), (4,)]


def test_a_joined_ray_cluster_owns_its_gpus_an_embedded_one_takes_the_shells():
    cfg = build_config({**GPU2, "backend": "ray"}, "r.yaml")
    shell = {"CUDA_VISIBLE_DEVICES": "5,6"}
    assert _devices(make_plan(cfg, environ=shell)) == [(5,), (6,)]
    assert _devices(make_plan(cfg, environ={**shell, "RAY_ADDRESS": "10.0.0.1:6379"})) == [(0,), (1,)]


def test_a_torchrun_rank_sees_its_machines_gpus_a_ray_rank_its_own():
    for backend, seen in (("torchrun", [(0, "0,1"), (1, "0,1")]), ("ray", [(0, "0"), (0, "1")])):
        plan = make_plan(build_config({**GPU2, "backend": backend}, "x.yaml"))
        assert [(p.local_rank, p.env["CUDA_VISIBLE_DEVICES"]) for p in plan.workers] == seen, backend


def _live(*cpus: float):
    """A joined Ray cluster as `cluster_of` reads it: node i with cpus[i] CPUs, no GPUs."""
    from dualrun.plan.placement import Cluster, Node

    return Cluster(tuple(Node(i, f"10.0.0.{i + 1}", 0, c) for i, c in enumerate(cpus)), source="ray")


def _ray_cpu(strategy: str = "PACK", teacher: int = 0):
    from dualrun.config import build_config

    roles = {"train": {"gpus": 2}}
    if teacher:
        roles["teacher"] = {"gpus": teacher, "model": "m/m", "top_k": 5}
    return build_config({"backend": "ray", "use_cpu": True, "method": "gkd" if teacher else "sft", "roles": roles,
                         "ray": {"placement_strategy": strategy}}, "x.yaml")


def test_a_ray_node_without_cpus_runs_no_cpu_process_of_the_plan():
    """A head started with `ray start --head --num-cpus 0` (as examples/multi-node/ray-by-hand keeps it free): Ray
    places no rank or CPU server there, and neither does the plan that `dualrun plan` and `dualrun check` show."""
    from dualrun.plan.processes import make_plan

    plan = make_plan(_ray_cpu(teacher=2), _live(0, 3, 3))
    assert [p.node for p in plan.workers] == [1, 1]
    # each replica on the node with the most CPUs left (what Ray gives a one-bundle group), the router beside the first
    assert [(p.label, p.node) for p in plan.servers] == [("teacher server 0", 2), ("teacher server 1", 2),
                                                          ("teacher router", 2)]
    plan = make_plan(_ray_cpu("SPREAD", teacher=2), _live(0, 3, 3))
    assert [p.node for p in plan.workers] == [1, 2]   # SPREAD: one rank per node with room, in turn
    assert [p.node for p in plan.servers] == [1, 2, 1]


def test_a_planned_ray_cluster_keeps_every_cpu_process_where_it_did():
    """Without a live cluster (a dry run) the CPUs are unknown: the ranks fill node 0, the servers too."""
    from dualrun.plan.processes import make_plan

    plan = make_plan(_ray_cpu(teacher=2))
    assert {p.node for p in plan.processes} == {0}
