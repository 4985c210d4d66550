"""One placement policy per backend, and the launching shell's environment as a value the plan is given."""
from __future__ import annotations

from dualrun.config import build_config
from dualrun.plan.placement import RayPlacement, TorchrunPlacement, placement_for
from dualrun.plan.processes import make_plan

GPU2 = {"roles": {"train": {"gpus": 2}}}


def _devices(plan) -> list[tuple[int, ...]]:
    return [p.devices for p in plan.workers]


def test_the_backend_name_picks_the_policy():
    assert isinstance(placement_for(build_config(GPU2, "t.yaml")), TorchrunPlacement)
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
