"""The Ray half of separate roles, on a real local Ray cluster with fake GPUs: the teacher server runs in an actor
of its own placement group (its own GPU), serves the teacher for real, fails with its log tail when it never gets
healthy, and leaves no process, actor or placement group behind. (RayServers is what the Ray launcher calls; a
whole `dualrun launch --backend ray` GKD job with a separate teacher is test_methods.py[gkd_separate_teacher].)"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from helpers import REPO, gone

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180), pytest.mark.slow, pytest.mark.ray]


@pytest.fixture(scope="module")
def local_ray():
    import ray

    if ray.is_initialized():   # connected to the run's shared cluster (conftest.ray_cluster): this module starts its own
        ray.shutdown()
    ray.init(address="local", num_cpus=4, num_gpus=3, include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    yield ray
    ray.shutdown()


def _servers(tiny: Path, ray_opts: dict | None = None, **teacher: object):
    from dualrun.config import build_config
    from dualrun.backends.ray import cluster as rc
    from dualrun.launchers.launcher import Program
    from dualrun.backends.ray.actor_launcher import RayLauncher
    from dualrun.plan.processes import make_plan
    from dualrun.methods.plugin import get_plugin
    from dualrun.backends.ray.actor_servers import RayServers

    spec = {"gpus": 1, "model": str(tiny / "teacher"), "top_k": 5, "engine": "transformers", "health_timeout_s": 90}
    spec.update(teacher)
    cfg = build_config({"backend": "ray", "method": "gkd", "roles": {"train": {"gpus": 2}, "teacher": spec},
                        "ray": ray_opts or {}}, "t.yaml")
    plugin = get_plugin("gkd")
    plugin.validate(cfg)
    launcher = RayLauncher(cfg, Program("t.py"), {}, plugin=plugin)
    plan = launcher.prepare(make_plan(cfg, rc.cluster_of(rc.alive_nodes()), plugin)).plan   # the method's commands in it
    servers = launcher.server_set(plan, 0, frozenset())
    assert isinstance(servers, RayServers)
    return plan, servers


def test_teacher_server_in_its_own_placement_group(local_ray, module_tiny, capfd):
    from ray.util import placement_group_table

    from dualrun.servers.process import http_ok
    from dualrun.rank.teacher import teacher_client

    plan, servers = _servers(module_tiny)
    trainer_gpus = {d for p in plan.workers for d in p.devices}
    assert [p.devices for p in plan.servers] != [] and not trainer_gpus & set(plan.servers[0].devices)
    try:
        addresses = servers.start()
        address = addresses["teacher"]
        assert servers.wiring_env() == {"DUALRUN_TEACHER_ADDRESS": address}
        gpus = servers.server_devices()["teacher server 0"]
        assert len(gpus) == 1, gpus                                         # the actor holds exactly its GPU
        assert local_ray.available_resources().get("GPU", 0) == 2          # ... leaving the trainers' two
        client = teacher_client(f"http://{address}")
        got = client.get_sequence_logprobs([[1, 5, 9, 12]], [1], top_logprobs=5)
        assert len(got["logprobs"][0]) == 3 and len(got["logprobs"][0][0]) == 5
        pid = local_ray.get(servers.actors[0].where.remote()).pid
    finally:
        servers.stop()
    err = capfd.readouterr().err   # the server's output on this driver, as under torchrun: loading to stopping
    loading = re.search(rf"\[teacher server 0\] dualrun engine: loading {re.escape(str(module_tiny / 'teacher'))} "
                        r"\(pid (\d+)\)", err)
    assert loading and "[teacher server 0] dualrun engine: serving" in err, err
    assert gone(int(loading.group(1)))   # the server itself, not only its actor
    assert not http_ok(f"http://{address}/health")
    assert servers.actors == [] and servers.pgs == []
    time.sleep(1)
    assert gone(pid)
    assert all(t["state"] == "REMOVED" for t in placement_group_table().values())


def test_never_healthy_on_ray_fails_with_log_tail_and_cleans_up(local_ray, module_tiny):
    from dualrun.contract.errors import LaunchError

    _, servers = _servers(module_tiny, health_timeout_s=2, server_args=["--startup-delay", "60"])
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as e:
        servers.start()
    assert time.monotonic() - t0 < 60
    assert "teacher server 0 did not become healthy within 2 s" in str(e.value)
    assert "dualrun engine: loading" in str(e.value)
    assert servers.actors == [] and servers.pgs == []
    deadline = time.monotonic() + 10
    while local_ray.available_resources().get("GPU", 0) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert local_ray.available_resources().get("GPU", 0) == 3
    assert os.environ.get("DUALRUN_TEACHER_ADDRESS") is None


def test_a_server_ray_cannot_place_fails_like_the_trainers_exit_2(local_ray, module_tiny):
    """The cluster could hold the teacher, but not now: after ray.placement_timeout_s the same line (and exit
    code 2) as for trainer ranks and role groups, and no placement group or actor is left."""
    from ray.util import placement_group_table
    from ray.util.placement_group import placement_group, remove_placement_group

    from dualrun.contract.errors import LaunchError

    _, servers = _servers(module_tiny, ray_opts={"placement_timeout_s": 1})
    blocker = placement_group([{"GPU": 3}])   # every GPU taken for now
    local_ray.get(blocker.ready(), timeout=30)
    try:
        with pytest.raises(LaunchError, match=r"t\.yaml: role\(s\) teacher: 1 server\(s\) .* within "
                                              r"ray\.placement_timeout_s=1 s") as e:
            servers.start()
        assert e.value.exit_code == 2
        assert servers.actors == [] and servers.pgs == []
        assert not [p for p in placement_group_table().values()
                    if p.get("name", "").startswith(servers.run_id) and p.get("state") != "REMOVED"]
    finally:
        remove_placement_group(blocker)
