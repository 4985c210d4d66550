"""Several vLLM CPU engines on one machine each bind their OpenMP threads to cores of their own (vLLM's "auto"
binding gives every engine the same first cores)."""
from __future__ import annotations

import pytest

from dualrun import protocol
from dualrun.config import build_config
from dualrun.plan import Cluster, make_plan
from dualrun.servers.cpu_share import OMP_BIND, bind_share, cores_for
from dualrun.servers.process import ServerProcess


@pytest.mark.parametrize("allowed, count, shares", [
    ([0, 1], 2, [[0], [1]]),
    ([0, 1, 2, 3, 4], 2, [[0, 1, 2], [3, 4]]),
    ([4, 5, 6, 7], 4, [[4], [5], [6], [7]]),
    ([0, 1], 3, [[0], [1], [0]]),          # more engines than cores: one core each, in turn
])
def test_shares_are_contiguous_disjoint_and_cover_the_allowed_cores(allowed, count, shares):
    assert [cores_for(allowed, i, count) for i in range(count)] == shares


def test_the_share_becomes_the_binding_unless_one_is_set():
    assert bind_share({protocol.CPU_SHARE: "1/2"}, allowed=[2, 3, 0, 1])[OMP_BIND] == "2,3"
    assert bind_share({protocol.CPU_SHARE: "1/2", OMP_BIND: "nobind"}, allowed=[0, 1])[OMP_BIND] == "nobind"
    assert OMP_BIND not in bind_share({"A": "1"}, allowed=[0, 1])
    server = ServerProcess("s", ["true"], {protocol.CPU_SHARE: "0/1"}, "127.0.0.1", 1)
    assert server.env[OMP_BIND]   # resolved where the server starts, from the machine's allowed cores


def _plan(engine: str, gpus: int = 2, **extra):
    cfg = build_config({"use_cpu": True, "method": "gkd",
                        "roles": {"train": {"gpus": 1}, "teacher": {"gpus": gpus, "engine": engine, "model": "m",
                                                                    **extra}}}, "x.yaml")
    return make_plan(cfg)


def test_the_plan_marks_each_vllm_cpu_engine_on_a_machine_with_its_share():
    shares = [p.env.get(protocol.CPU_SHARE) for p in _plan("vllm").servers if p.kind == "server"]
    assert shares == ["0/2", "1/2"]


def test_one_engine_or_the_transformers_engine_is_left_to_itself():
    assert all(protocol.CPU_SHARE not in p.env for p in _plan("vllm", gpus=1).servers)
    assert all(protocol.CPU_SHARE not in p.env for p in _plan("transformers").servers)
    assert all(protocol.CPU_SHARE not in p.env for p in make_plan(build_config(
        {"roles": {"train": {"gpus": 2}, "teacher": {"gpus": 2, "model": "m"}}}, "x.yaml")).servers)
