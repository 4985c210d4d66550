"""Several vLLM CPU engines on one machine each bind their OpenMP threads to cores of their own (vLLM's "auto"
binding gives every engine the same first cores)."""
from __future__ import annotations

import pytest

from dualrun.contract import protocol
from dualrun.config import build_config
from dualrun.plan.processes import Cluster, make_plan
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


def test_an_engine_run_in_one_process_says_its_share_cannot_apply(tmp_path):
    """`VLLM_ENABLE_V1_MULTIPROCESSING=0` in a role's env: vLLM binds threads only in a worker process, so the
    engine's output says in one line that it runs unbound (once per engine, where it starts)."""
    import io
    import sys

    from dualrun.servers.cpu_share import IN_PROCESS, unbound_note

    assert unbound_note({protocol.CPU_SHARE: "1/2", IN_PROCESS: "0"})
    assert unbound_note({protocol.CPU_SHARE: "1/2"}) is None            # vLLM's own processes: bound
    assert unbound_note({protocol.CPU_SHARE: "0/1", IN_PROCESS: "0"}) is None   # alone on its machine
    assert unbound_note({IN_PROCESS: "0"}) is None                       # no share planned
    out, log = io.StringIO(), tmp_path / "s.log"
    server = ServerProcess("rollout 1", [sys.executable, "-c", "pass"], {protocol.CPU_SHARE: "1/2", IN_PROCESS: "0"},
                           "127.0.0.1", 1, stream=out, log_path=str(log))
    server.start()
    server.proc.wait(timeout=30)
    server.stop()
    lines = [t for t in out.getvalue().splitlines() if IN_PROCESS in t]
    assert len(lines) == 1 and lines[0].startswith("[rollout 1] dualrun: ") and "unbound" in lines[0], out.getvalue()
    assert IN_PROCESS in log.read_text()
