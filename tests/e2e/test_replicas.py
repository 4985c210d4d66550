"""A separate role with more devices than one engine: `gpus / tensor_parallel_size` replicas behind one router.

Planning is pure (milliseconds); the dry run shows every replica and the router; the launchers' LocalServers start
replicas then router and hand the trainers the router's address. The end-to-end runs (both backends, the CPU
engine, real TRL GKD and a watched replica that is killed) are in test_replicas_e2e.py.
"""
from __future__ import annotations

import re

import pytest

from helpers import REPO, dualrun
from dualrun.config import build_config
from dualrun.contract.errors import ConfigError
from dualrun.plan.processes import ROUTER, Cluster, make_plan
from dualrun.plan.server_commands import server_command, with_method
from dualrun.servers.planned import addresses, phases, replica_addresses


def _cfg(teacher: dict, backend: str = "torchrun", **top) -> object:
    spec = {"model": "m/m", "top_k": 5, **teacher}
    return build_config({"backend": backend, "method": "gkd", **top,
                         "roles": {"train": {"gpus": 2}, "teacher": spec}}, "job.yaml")


def test_gpus_over_tensor_parallel_size_plans_that_many_replicas_and_a_router():
    plan = make_plan(_cfg({"gpus": 4, "tensor_parallel_size": 2}))
    servers = plan.servers
    assert [(p.kind, p.label, p.devices) for p in servers] == [
        ("server", "teacher server 0", (2, 3)), ("server", "teacher server 1", (4, 5)),
        (ROUTER, "teacher router", ())]
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in servers] == ["2,3", "4,5", ""]
    assert all(p.world_size == 2 for p in servers)                       # replica `rank` of `world_size`
    assert phases(plan) == [[0, 1], [2]]                                 # replicas first, then the router
    assert "CPU          teacher router" in plan.table()


def test_one_engine_is_planned_as_before_without_a_router():
    plan = make_plan(_cfg({"gpus": 2, "tensor_parallel_size": 2}))
    assert [(p.kind, p.label, p.devices) for p in plan.servers] == [("server", "teacher server 0", (2, 3))]
    assert phases(plan) == [[0]]


def test_cpu_engine_is_one_process_per_replica():
    plan = make_plan(_cfg({"gpus": 3}, use_cpu=True))
    assert [p.label for p in plan.servers] == ["teacher server 0", "teacher server 1", "teacher server 2",
                                               "teacher router"]
    assert all(p.devices == () for p in plan.servers)


def test_ray_places_each_replica_on_any_node():
    cfg = _cfg({"gpus": 4, "tensor_parallel_size": 2}, backend="ray")
    plan = make_plan(cfg, Cluster.uniform(3, 2))
    replicas = [p for p in plan.servers if p.kind != ROUTER]
    assert [(p.node, p.devices) for p in replicas] == [(1, (0, 1)), (2, (0, 1))]
    assert plan.servers[-1].kind == ROUTER and plan.servers[-1].node == 1


@pytest.mark.parametrize("teacher, key, expected", [
    ({"gpus": 3, "tensor_parallel_size": 2}, "roles.teacher.tensor_parallel_size", "a divisor of roles.teacher.gpus=3"),
    ({"gpus": 4, "tensor_parallel_size": 2, "engine": "transformers"}, "roles.teacher.tensor_parallel_size",
     "1 with engine `transformers`"),
    ({"gpus": 4, "tensor_parallel_size": 1, "data_parallel_size": 3}, "roles.teacher.gpus",
     "a multiple of tensor_parallel_size x data_parallel_size (1 x 3)"),
])
def test_layouts_that_do_not_split_into_engines_are_config_errors(teacher, key, expected):
    with pytest.raises(ConfigError) as e:
        cfg = _cfg(teacher)
        from dualrun.methods.plugin import get_plugin

        get_plugin(cfg.method).validate(cfg)
    assert e.value.key == key and expected in str(e.value)


def test_replicas_that_cannot_be_placed_are_a_config_error():
    cfg = _cfg({"gpus": 4, "tensor_parallel_size": 2}, backend="ray")
    with pytest.raises(ConfigError, match="roles.teacher.gpus: expected 2 free GPUs on one node for each of its 2 "
                                          "engines"):
        make_plan(cfg, Cluster.uniform(3, 1))


def test_router_command_and_the_trainers_address():
    cfg = _cfg({"gpus": 2})
    plan = make_plan(cfg)
    router = plan.servers[-1]
    started = {0: "127.0.0.1:9001", 1: "127.0.0.1:9002"}
    assert replica_addresses(plan, started, 2) == ["127.0.0.1:9001", "127.0.0.1:9002"]
    argv = server_command(cfg, None, router, "127.0.0.1", 9000, replica_addresses(plan, started, 2))
    assert argv[1:] == ["-m", "dualrun.programs.router", "--host", "127.0.0.1", "--port", "9000",
                        "--replica", "127.0.0.1:9001", "--replica", "127.0.0.1:9002", "--request-timeout-s", "1800"]
    argv = server_command(_cfg({"gpus": 2, "request_timeout_s": 90.5}), None, router, "127.0.0.1", 9000, ["a:1"])
    assert argv[-2:] == ["--request-timeout-s", "90.5"]              # the role's request_timeout_s
    assert addresses(plan, {**started, 2: "127.0.0.1:9000"}) == {"teacher": "127.0.0.1:9000"}
    assert [p.serving.log_name for p in plan.servers] == [
        "teacher-server-0.log", "teacher-server-1.log", "teacher-router.log"]


@pytest.mark.parametrize("backend", ["torchrun", "ray"])
def test_a_four_engine_rollout_is_four_cpu_engines_behind_one_router(backend):
    """The issue's layout, `roles.rollout: {gpus: 4, tensor_parallel_size: 1}`, on the CPU engine: four replicas
    of the rollout model, a router in front of all four, and the trainers wired to the router only."""
    from dualrun.methods.plugin import get_plugin

    cfg = build_config({"backend": backend, "method": "grpo", "use_cpu": True, "roles": {
        "train": {"gpus": 1},
        "rollout": {"gpus": 4, "tensor_parallel_size": 1, "model": "m/m", "engine": "transformers"}}}, "job.yaml")
    plugin = get_plugin("grpo")
    plugin.validate(cfg)
    plan = make_plan(cfg, Cluster.uniform(1, 0) if backend == "ray" else None)
    assert [p.label for p in plan.servers] == [f"rollout server {i}" for i in range(4)] + ["rollout router"]
    assert phases(plan) == [[0, 1, 2, 3], [4]]
    started = {i: f"127.0.0.1:{9001 + i}" for i in range(4)}
    for i, p in enumerate(plan.servers[:4]):
        argv = server_command(cfg, plugin, p, "127.0.0.1", 9001 + i)
        assert argv[1:5] == ["-m", "dualrun.programs.cpu_engine", "--model", "m/m"]
    router = server_command(cfg, plugin, plan.servers[4], "127.0.0.1", 9000, replica_addresses(plan, started, 4))
    assert router[router.index("--replica"):-2] == [w for a in started.values() for w in ("--replica", a)]
    assert addresses(plan, {**started, 4: "127.0.0.1:9000"}) == {"rollout": "127.0.0.1:9000"}
    assert plugin.wiring_env(cfg, {"rollout": "127.0.0.1:9000"})["DUALRUN_ROLLOUT_ADDRESS"] == "127.0.0.1:9000"


def _cli_dir(tmp_path, teacher: str):
    (tmp_path / "job.yaml").write_text(f"use_cpu: true\nmethod: gkd\nroles:\n  train: {{gpus: 1}}\n"
                                       f"  teacher: {{model: {tmp_path}, top_k: 5, {teacher}}}\n")
    (tmp_path / "train.py").write_text("print('hi')\n")


@pytest.mark.parametrize("backend", ["torchrun", "ray"])
def test_dry_run_shows_each_replica_and_the_router(tmp_path, backend):
    _cli_dir(tmp_path, "gpus: 2")
    proc = dualrun("launch", "--dry_run", "--backend", backend, "--config_file", "job.yaml", "train.py",
                   cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "teacher server 0" in out and "teacher server 1" in out and "teacher router" in out, out
    if backend == "torchrun":
        assert "dualrun.programs.router --host 127.0.0.1 --port '<auto>' --replica '<auto>' --replica '<auto>'" in out


def test_gpus_not_a_multiple_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "job.yaml").write_text("method: gkd\nroles:\n  train: {gpus: 1}\n"
                                       f"  teacher: {{gpus: 3, tensor_parallel_size: 2, model: {tmp_path}, top_k: 5}}\n")
    proc = dualrun("plan", "--config_file", "job.yaml", cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "job.yaml" in proc.stderr
    assert "roles.teacher.tensor_parallel_size" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.e2e
@pytest.mark.slow
def test_replica_throughput_benchmark_runs(tmp_path, tiny):
    """The benchmark must not rot: one short round of each layout; completions equal, both replicas used."""
    import subprocess
    import sys

    out = tmp_path / "replicas.md"
    bench = REPO / "benchmarks" / "replica_throughput.py"
    r = subprocess.run([sys.executable, str(bench), "--model", str(tiny / "model"), "--requests", "4",
                        "--max-tokens", "4", "--concurrency", "2", "--rounds", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    text = out.read_text()
    assert "| 2 replicas behind the router |" in text and "| NO |" not in text
    served = re.search(r"2-replica rounds: \[(\d+), (\d+)\]", text)
    assert served and all(int(n) >= 1 for n in served.groups()), text


@pytest.mark.e2e
@pytest.mark.slow   # two CPU engines (torch, transformers, the model each) and a router: ~8 CPU-s
def test_local_servers_start_replicas_then_router_and_watch_the_router(tmp_path, tiny):
    """What the torchrun launcher does with the plan's servers, without a trainer: the role's address is the
    router's, its health is green through both replicas; a router that dies is the job's failure, named."""
    import os
    import signal

    from dualrun.methods.plugin import get_plugin
    from dualrun.servers.local import LocalServers
    from dualrun.servers.process import http_ok

    cfg = _cfg({"gpus": 2, "model": str(tiny / "teacher"), "health_timeout_s": 120}, use_cpu=True,
               log_dir=str(tmp_path))
    plan = with_method(make_plan(cfg), cfg, get_plugin("gkd"))
    servers = LocalServers(plan, lambda p: dict(os.environ, **p.env), stream=None)
    with servers:
        address = servers.start()["teacher"]
        router = servers.running[2]
        assert router.address == address and [s.label for s in servers.running.values()] == [
            "teacher server 0", "teacher server 1", "teacher router"]
        assert http_ok(f"http://{address}/health")
        servers.watch()
        os.kill(router.proc.pid, signal.SIGKILL)
        death = servers.next_death(timeout=10)   # the event: which server, how it ended
        assert death is not None and death.index == 2 and servers.failure is death
        assert death.one_line().startswith("teacher router exited with code -9 (killed by SIGKILL)")
    assert not router.alive() and not servers.running


@pytest.mark.e2e
@pytest.mark.slow
def test_local_servers_restart_a_dead_replica_until_its_restarts_are_spent(tmp_path, tiny, capfd):
    """`replica_restarts: 1`: a replica SIGKILLed while watched is no event; it comes back on a fresh port and its
    router takes it back (both in rotation, the role's address unchanged). Killed again, it is the job's failure."""
    import os
    import signal

    from dualrun.methods.plugin import get_plugin
    from dualrun.servers import router_client
    from dualrun.servers.local import LocalServers
    from dualrun.servers.process import http_ok
    from helpers import eventually

    cfg = _cfg({"gpus": 2, "model": str(tiny / "teacher"), "health_timeout_s": 120, "replica_restarts": 1},
               use_cpu=True, log_dir=str(tmp_path))
    servers = LocalServers(with_method(make_plan(cfg), cfg, get_plugin("gkd")), lambda p: dict(os.environ, **p.env),
                           stream=None)
    with servers:
        address = servers.start()["teacher"]
        first = servers.running[1]
        servers.watch()
        os.kill(first.proc.pid, signal.SIGKILL)
        err: list[str] = []
        # (servers.running has no replica 1 while its fresh process starts)
        assert eventually(lambda: err.append(capfd.readouterr().err) or "teacher server 1 is back in rotation at "
                          f"{getattr(servers.running.get(1), 'address', '?')}" in "".join(err)
                          or servers.failure is not None, timeout=120)
        assert servers.failure is None and servers.next_death() is None, servers.failure
        assert re.search(r"dualrun: teacher server 1 exited with code -9 \(killed by SIGKILL\) while the job was "
                         r"running.*; restarting it on the same devices \(restart 1 of 1, replica_restarts\)\n",
                         "".join(err))
        second = servers.running[1]
        assert second.port != first.port and second.alive() and not first.alive()
        table = router_client.replicas(address)
        assert table["in_rotation"] == [0, 1] and table["replicas"][1]["address"] == second.address
        assert servers.addresses["teacher"] == address and http_ok(f"http://{address}/health")
        os.kill(second.proc.pid, signal.SIGKILL)   # restarts spent: the job's failure
        death = servers.next_death(timeout=10)
        assert death is not None and death.index == 1 and servers.failure is death
        assert death.one_line().startswith("teacher server 1 exited with code -9 (killed by SIGKILL)")
    assert not second.alive() and not servers.running
