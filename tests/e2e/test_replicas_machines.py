"""A separate role's engine replicas across several torchrun machines (started by hand, like accelerate).

Planning is pure (milliseconds): replicas fill the GPUs the trainers leave on machine 0, then machine 1, ...
(`torchrun.gpus_per_machine`, or the launching shell's CUDA_VISIBLE_DEVICES), each replica on one machine, the
router on machine 0; what cannot be placed is a config error naming the key. End to end: two `dualrun launch`
machines on one host, real TRL GKD with a CPU-engine teacher whose two replicas run one on each machine; both
machines' ranks get the same router address, every replica is served, and nothing is left running; a replica that
dies on machine 1 is restarted there (`replica_restarts`) while the job goes on, or with `replica_restarts: 0`
restarts both machines (`max_failures`), and machine 0's router dying ends both, named.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ASSETS, dualrun, eventually, health_server, link_tiny, pids_matching
from dualrun.config import build_config
from dualrun.contract.errors import ConfigError
from dualrun.plan.processes import ROUTER, make_plan
from dualrun.plan.server_commands import with_method
from dualrun.servers.supervision import restartable



def _cfg(teacher: dict, train: int = 4, machines: int = 2, rank: int = 0, **torchrun) -> object:
    spec = {"model": "m/m", "top_k": 5, **teacher}
    return build_config({"method": "gkd", "num_machines": machines, "machine_rank": rank,
                         "main_process_ip": "10.0.0.1", "torchrun": torchrun,
                         "roles": {"train": {"gpus": train}, "teacher": spec}}, "job.yaml")


def _replicas(plan) -> list[tuple[int, tuple[int, ...]]]:
    return [(p.node, p.devices) for p in plan.servers if p.kind != ROUTER]


def test_replicas_fill_machine_0_then_machine_1_each_on_one_machine():
    plan = make_plan(_cfg({"gpus": 4, "tensor_parallel_size": 2}, gpus_per_machine=4))
    assert [(p.node, p.devices) for p in plan.workers] == [(0, (0,)), (0, (1,)), (1, (0,)), (1, (1,))]
    assert _replicas(plan) == [(0, (2, 3)), (1, (2, 3))]
    router = plan.servers[-1]
    assert router.kind == ROUTER and router.node == 0 and router.devices == ()
    table = plan.table()
    assert re.search(r"node 0 .*\n(.*\n)*  GPU 2,3 +teacher server 0\n  CPU +teacher router", table), table
    assert re.search(r"node 1 node1: 4 GPU\(s\)\n(.*\n)*  GPU 2,3 +teacher server 1", table), table


def test_machine_0_is_filled_first():
    plan = make_plan(_cfg({"gpus": 4}, train=2, gpus_per_machine=4))
    assert _replicas(plan) == [(0, (1,)), (0, (2,)), (0, (3,)), (1, (1,))]


def test_without_a_machine_size_every_server_stays_on_machine_0():
    plan = make_plan(_cfg({"gpus": 4, "tensor_parallel_size": 2}))
    assert _replicas(plan) == [(0, (2, 3)), (0, (4, 5))]


def test_the_launching_shells_visible_gpus_are_each_machines():
    shell = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    plan = make_plan(_cfg({"gpus": 4, "tensor_parallel_size": 2}), environ=shell)
    assert _replicas(plan) == [(0, (6, 7)), (1, (6, 7))]
    with pytest.raises(ConfigError) as e:
        make_plan(_cfg({"gpus": 2}, gpus_per_machine=8), environ=shell)
    assert e.value.key == "torchrun.gpus_per_machine" and "CUDA_VISIBLE_DEVICES count, 4" in str(e.value)


@pytest.mark.parametrize("teacher, per_machine, expected", [
    ({"gpus": 4, "tensor_parallel_size": 4}, 4, "at most 3 free GPUs on one node for a separate role"),
    ({"gpus": 6, "tensor_parallel_size": 2}, 3, "2 free GPUs on one node for each of its 3 engines (engine 2 "
                                                "finds at most 0)"),
    ({"gpus": 8}, 4, "1 free GPUs on one node for each of its 8 engines (engine 6 finds at most 0)"),
])
def test_replicas_that_fit_no_machine_are_a_config_error(teacher, per_machine, expected):
    with pytest.raises(ConfigError) as e:
        make_plan(_cfg(teacher, train=2, gpus_per_machine=per_machine))
    assert e.value.key == "roles.teacher.gpus" and expected in str(e.value), str(e.value)


def _cpu_cfg(teacher_processes: int, rank: int = 0) -> object:
    return build_config({"method": "gkd", "use_cpu": True, "num_machines": 2, "main_process_ip": "10.0.0.1",
                         "machine_rank": rank,
                         "torchrun": {"gpus_per_machine": 2}, "roles": {
                             "train": {"gpus": 2}, "teacher": {"gpus": teacher_processes, "model": "m/m", "top_k": 5}}},
                        "job.yaml")


def test_each_machine_restarts_the_replicas_it_runs():
    from dualrun.methods.plugin import get_plugin
    from dualrun.servers.local import LocalServers

    for rank in (0, 1):
        cfg = _cpu_cfg(2, rank)
        plan = with_method(make_plan(cfg), cfg, get_plugin("gkd"))
        servers = LocalServers(plan, dict, stream=None)
        assert servers.supervisor.table.left == {rank: 3} and restartable(plan) == {0, 1}


def test_cpu_replicas_take_process_slots():
    plan = make_plan(_cpu_cfg(2))
    assert _replicas(plan) == [(0, ()), (1, ())]
    assert plan.servers[-1].kind == ROUTER and plan.servers[-1].node == 0
    with pytest.raises(ConfigError, match=r"roles.teacher.gpus: expected 1 free process slots "
                                          r"\(torchrun.gpus_per_machine\) on one node for each of its 3 engines"):
        make_plan(_cpu_cfg(3))


def test_dry_run_of_machine_1_shows_the_replica_it_starts(tmp_path):
    (tmp_path / "job.yaml").write_text(
        "use_cpu: true\nmethod: gkd\ntorchrun: {gpus_per_machine: 2}\nroles:\n  train: {gpus: 2}\n"
        f"  teacher: {{gpus: 2, model: {tmp_path}, top_k: 5}}\n")
    (tmp_path / "train.py").write_text("print('hi')\n")
    out = dualrun("launch", "--config_file", "job.yaml", "--num_machines", "2", "--machine_rank", "1",
                  "--main_process_ip", "10.0.0.1", "--dry_run", "train.py", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "# teacher server 1, started beside the trainers" in out.stdout
    assert "teacher server 0, started" not in out.stdout and "teacher router, started" not in out.stdout


# -- end to end: two machines on one host --------------------------------------------------------------------
def _gkd(tmp_path: Path, tiny: Path, *more: str) -> list[str]:
    return [str(ASSETS / "gkd_probe.py"), "--model_name_or_path", str(tiny / "model"), "--teacher_model_name_or_path",
            str(tiny / "teacher"), "--data", str(tiny / "data" / "gkd.jsonl"), "--output_dir", str(tmp_path / "out"),
            *more]


def _two_machines(tmp_path: Path, tiny: Path, program: list[str], extra: str = "",
                  teacher: str = "") -> list[subprocess.Popen]:
    """Both machines' `dualrun launch` of a GKD job whose teacher has a replica on each (stdout and stderr in
    m{rank}/out and m{rank}/err; logs in logs{rank}); `extra`: more top-level YAML, `teacher`: more teacher keys."""
    from dualrun.light.ports import free_port

    port = free_port()
    (tmp_path / "job.yaml").write_text(
        f"use_cpu: true\nmethod: gkd\n{extra}torchrun: {{gpus_per_machine: 2}}\nroles:\n  train: {{gpus: 2}}\n"
        f"  teacher: {{gpus: 2, model: {tiny / 'teacher'}, top_k: 5, health_timeout_s: 120, "
        f"server_args: [--verbose]{teacher}}}\n")
    cmd = [sys.executable, "-m", "dualrun", "launch", "--config_file", "job.yaml", "--num_machines", "2",
           "--machine_rank", "{rank}", "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), *program]
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1"}
    procs = []
    for rank in (0, 1):
        here = tmp_path / f"m{rank}"
        here.mkdir()
        (here / "job.yaml").write_text((tmp_path / "job.yaml").read_text() + f"log_dir: {tmp_path / f'logs{rank}'}\n")
        with open(here / "out", "w") as out, open(here / "err", "w") as err:
            procs.append(subprocess.Popen([c.format(rank=rank) for c in cmd], cwd=here, env=env, stdout=out,
                                          stderr=err, text=True))
    return procs


def _ended(tmp_path: Path, procs: list[subprocess.Popen], timeout_s: float) -> list[tuple[str, str]]:
    """Wait for both machines (killing what is left after `timeout_s`: a hung machine must not outlive the test);
    their (stdout, stderr)."""
    from cluster_jobs import wait_all

    wait_all(procs, timeout_s)
    return [((tmp_path / f"m{r}" / "out").read_text(), (tmp_path / f"m{r}" / "err").read_text()) for r in (0, 1)]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_machines_serve_one_teacher_behind_machine_0s_router(tmp_path, tiny):
    tiny = link_tiny(tiny, tmp_path)   # the teacher's path under this test's own directory marks its servers
    procs = _two_machines(tmp_path, tiny, _gkd(tmp_path, tiny))
    outs = _ended(tmp_path, procs, 270)
    assert [p.returncode for p in procs] == [0, 0], [o[1][-3000:] for o in outs]
    ranks = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in (0, 1)]
    address = ranks[0]["teacher_address"]
    assert address == ranks[1]["teacher_address"] and address.startswith("127.0.0.1:")   # one address: the router's
    assert f"dualrun: teacher: server healthy at {address}" in outs[0][1]
    assert re.search(r"dualrun: teacher server 1: server healthy at 127\.0\.0\.1:\d+ \(machine 1\)", outs[1][1])
    router_log = (tmp_path / "logs0" / "teacher-router.log").read_text()
    assert re.search(rf"serving http://0\.0\.0\.0:{address.rpartition(':')[2]} for 2 replicas: 127\.0\.0\.1:\d+ "
                     r"127\.0\.0\.1:\d+\n", router_log), router_log
    assert not (tmp_path / "logs1" / "teacher-router.log").exists()
    spread = re.search(r"served per replica: \[(\d+), (\d+)\]", router_log)
    assert spread and all(int(n) >= 1 for n in spread.groups()), router_log[-500:]
    # each machine ran its own replica, and each replica's own log counts the scoring requests it answered
    served = [(tmp_path / f"logs{m}" / f"teacher-server-{m}.log").read_text().count('"POST /v1/completions')
              for m in (0, 1)]
    assert all(n >= 1 for n in served), served
    assert not (tmp_path / "logs0" / "teacher-server-1.log").exists()
    assert not (tmp_path / "logs1" / "teacher-server-0.log").exists()
    assert all(len(r["losses"]) == 2 and all(x == x and x >= 0 for x in r["losses"]) for r in ranks)
    assert eventually(lambda: not pids_matching(str(tiny / "teacher")))   # replicas and router are gone


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_both_machines_restart_for_machine_1s_replica_then_end_naming_machine_0s_router(tmp_path, tiny):
    """`max_failures: 1` and a stand-in trainer that asks the router's /health every step. SIGKILL machine 1's
    replica: both machines restart in step (machine 1 waits for machine 0's new store) with a fresh replica and
    router. Then SIGKILL machine 0's router: the budget is spent, so both end with exit 1 within seconds, machine 0
    naming its router's exit and machine 1 the router that stopped answering; nothing is left running."""
    import signal
    import time

    from helpers import gone

    tiny = link_tiny(tiny, tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    procs = _two_machines(tmp_path, tiny, [str(ASSETS / "uses_teacher.py"), str(out), "100000"], "max_failures: 1\n",
                          ", replica_restarts: 0")   # a dead replica restarts the job, not itself
    steps = lambda: len(list(out.glob("step_1_*")))  # noqa: E731 - rank 1's steps so far, over both attempts

    def port_in(log: Path, pattern: str) -> str:
        assert eventually(lambda: log.exists() and re.search(pattern, log.read_text()), 200, 0.5), \
            _ended(tmp_path, procs, 0)
        return re.findall(pattern, log.read_text())[-1]   # the newest attempt's

    assert eventually(lambda: steps() >= 2, 200, 0.5), _ended(tmp_path, procs, 0)
    replica = port_in(tmp_path / "logs1" / "teacher-server-1.log", r"on http://0\.0\.0\.0:(\d+) ")
    os.kill(*pids_matching(str(tiny / "teacher"), "cpu_engine", f"--port {replica}"), signal.SIGKILL)
    assert eventually(lambda: (out / "address_1_1.json").exists(), 200, 0.5), _ended(tmp_path, procs, 0)
    before = steps()
    assert eventually(lambda: steps() >= before + 2, 60, 0.5), _ended(tmp_path, procs, 0)   # attempt 1 trains
    router = port_in(tmp_path / "logs0" / "teacher-router.log", r"serving http://0\.0\.0\.0:(\d+) ")
    [pid] = pids_matching("dualrun.programs.router", f"--port {router}")
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    outs = _ended(tmp_path, procs, 60)
    took = time.monotonic() - killed
    assert [p.returncode for p in procs] == [1, 1], [o[1][-3000:] for o in outs]
    assert took < 20, took   # about 10 s on an idle machine: detection ~2 s, then torchrun stops the ranks
    assert "teacher server 1 exited with code -9 (killed by SIGKILL) while the job was running" in outs[1][1]
    assert "teacher server 1 on machine 1 stopped answering its health check" in outs[0][1], outs[0][1][-2000:]
    assert all("restarting the job with fresh servers (1/1)" in o[1] for o in outs), [o[1][-2000:] for o in outs]
    first, second = ({json.loads((out / f"address_{a}_{r}.json").read_text()) for r in (0, 1)} for a in (0, 1))
    assert len(first) == len(second) == 1 and first != second   # one router per attempt, a fresh one after
    assert "teacher router exited with code -9 (killed by SIGKILL)" in outs[0][1], outs[0][1][-2000:]
    assert re.search(rf"teacher router on machine 0 stopped answering its health check \(http://127\.0\.0\.1:"
                     rf"{router}/router/stats: health probe: ", outs[1][1]), outs[1][1][-2000:]
    # the teacher's path is in every rank's and replica's command line
    assert gone(pid) and eventually(lambda: not pids_matching(str(tiny / "teacher"))), pids_matching(str(tiny))


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_machine_1_restarts_its_dead_replica_and_the_job_goes_on(tmp_path, tiny):
    """`replica_restarts` (the default) on two machines: SIGKILL machine 1's teacher replica while a stand-in trainer
    asks the router's /health every step. Machine 1 restarts it on a fresh port and hands it to machine 0's router;
    machine 0 takes its brief absence for the restart, not the job's end: both finish with 0, no step lost, one
    attempt, the log naming the death and the return; nothing is left running."""
    import signal

    tiny = link_tiny(tiny, tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    procs = _two_machines(tmp_path, tiny, [str(ASSETS / "uses_teacher.py"), str(out), "60"])
    steps = lambda: len(list(out.glob("step_1_*")))  # noqa: E731 - rank 1's steps so far
    assert eventually(lambda: steps() >= 2, 200, 0.5), _ended(tmp_path, procs, 0)
    log = tmp_path / "logs1" / "teacher-server-1.log"
    [replica] = re.findall(r"on http://0\.0\.0\.0:(\d+) ", log.read_text())
    os.kill(*pids_matching(str(tiny / "teacher"), "cpu_engine", f"--port {replica}"), signal.SIGKILL)
    outs = _ended(tmp_path, procs, 240)
    assert [p.returncode for p in procs] == [0, 0], [o[1][-3000:] for o in outs]
    assert re.search(r"dualrun: teacher server 1 exited with code -9 \(killed by SIGKILL\).*; restarting it on the "
                     r"same devices \(restart 1 of 3, replica_restarts\)", outs[1][1]), outs[1][1][-2000:]
    back = re.search(r"dualrun: teacher server 1 is back in rotation at 127\.0\.0\.1:(\d+), ", outs[1][1])
    assert back and back.group(1) != replica, outs[1][1][-2000:]
    assert not any("restarting the job" in o[1] or "stopped answering" in o[1] for o in outs), outs[0][1][-2000:]
    assert not list(out.glob("address_1_*"))   # one attempt
    assert len(list(out.glob("step_*"))) == 120   # every step of both ranks, the router answering throughout
    assert eventually(lambda: not pids_matching(str(tiny / "teacher")))


# -- machine 0 watches the other machines' replicas, and they watch its router ------------------------------
PROBE_S = 0.25   # the tests' health-check interval (a launcher's: backends.torchrun.machine_servers.PROBE_EVERY_S, 1 s): what they
#                 check is the count of misses and who is named, so they need not wait seconds of silence for it


@pytest.fixture
def quick_probes(monkeypatch):
    from dualrun.backends.torchrun import machine_servers as machines

    monkeypatch.setattr(machines, "PROBE_EVERY_S", PROBE_S)


def _after_silence(machines, server, finished: bool) -> str | None:
    """Stop `server` (another machine's, health-checked by `machines` every PROBE_S) and keep calling
    `machines.check()`: once that machine said it finished, no failure within 3.5 probe intervals (two misses fit);
    else the failure's line, within 10 s."""
    import time

    servers = machines.servers
    assert machines.check() is None                            # answering: fine
    server.shutdown()
    server.server_close()
    deadline = time.monotonic() + (3.5 * PROBE_S if finished else 10)
    while machines.check() is None and time.monotonic() < deadline:
        time.sleep(PROBE_S / 5)
    if finished:
        assert servers.failure is None
        return None
    assert servers.failure is not None and time.monotonic() < deadline
    return servers.failure.one_line()


@pytest.mark.e2e
def test_machine_0_names_another_machines_replica_that_stops_answering(quick_probes):
    """A real HTTP server stands in for machine 1's replica (its own launcher watches its process): machine 0's
    LocalServers health-checks it every PROBE_EVERY_S and, two misses after it stops, names it; once machine 1 has
    said its ranks finished (the store's key), the same silence is no failure."""
    from dualrun.methods.plugin import get_plugin
    from dualrun.servers.local import LocalServers
    from dualrun.backends.torchrun.machine_servers import Machines

    cfg = _cpu_cfg(2)
    plan = make_plan(cfg)
    for finished in (False, True):
        server = health_server()
        servers = LocalServers(with_method(plan, cfg, get_plugin("gkd")), dict, stream=None)
        machines = Machines(servers, "127.0.0.1", 1)
        machines.watched[1] = f"127.0.0.1:{server.server_address[1]}"   # what machine 1 published
        machines.finished_elsewhere = lambda machine: finished and machine == 1
        try:
            line = _after_silence(machines, server, finished)
            assert finished or line.startswith(
                f"teacher server 1 on machine 1 stopped answering its health check (http://127.0.0.1:"
                f"{server.server_address[1]}/health: health probe: ConnectionRefusedError: "), line
            assert finished or line.endswith(") while the job was running (that machine's launcher, if it is "
                                             "alive, names its exit)"), line
        finally:
            servers.stop()


@pytest.mark.e2e
@pytest.mark.slow
def test_a_busy_server_or_a_router_with_no_replica_in_rotation_on_another_machine_is_no_miss(quick_probes):
    """Machine 0's health check of machine 1's replica gives it the router's `PROBE_TIMEOUT_S` to answer (one that
    answers in 1.2 s, on a loaded machine, was two misses and the job's end with a 1-s bound), and machine 1's check
    of machine 0's router reads its table (its `/health` is 503 while no replica is in rotation: their state, not
    the router's). Neither is a miss over several checks; the same router silent is named within seconds."""
    import time

    from dualrun.methods.plugin import get_plugin
    from dualrun.servers.local import LocalServers
    from dualrun.backends.torchrun.machine_servers import Machines

    for rank, index, server in ((0, 1, health_server(delay_s=1.2)), (1, None, health_server(status={"/health": 503}))):
        cfg = _cpu_cfg(2, rank)
        plan = make_plan(cfg)
        index = index if index is not None else next(i for i, p in enumerate(plan.servers) if p.kind == ROUTER)
        servers = LocalServers(with_method(plan, cfg, get_plugin("gkd")), dict, stream=None)
        machines = Machines(servers, "127.0.0.1", 1)
        machines.watched[index] = f"127.0.0.1:{server.server_address[1]}"   # what the other machine published
        machines.finished_elsewhere = lambda machine: False
        try:
            for _ in range(3):   # three checks in a row: two misses would be a death
                machines._next_probe = 0.0
                assert machines.check() is None and not servers.supervisor.missing, servers.failure
            server.shutdown()
            server.server_close()
            started = time.monotonic()
            while machines.check() is None:
                assert time.monotonic() - started < 10
                time.sleep(PROBE_S / 5)
            assert servers.failure.index == index and "stopped answering its health check" in \
                servers.failure.one_line()
        finally:
            servers.stop()


@pytest.mark.e2e
def test_the_other_machines_servers_are_health_checked_at_once():
    """One round of machine 0's checks probes every watched server at the same time, so a server that hangs costs
    the round its own bound, not every server after it its bound as well. Two stand-in replicas answer only once
    both requests have arrived (a barrier; else 500): probed one after another, the first waits in vain."""
    import threading

    from dualrun.methods.plugin import get_plugin
    from dualrun.servers.local import LocalServers
    from dualrun.backends.torchrun.machine_servers import Machines

    cfg = _cpu_cfg(2)
    plan = make_plan(cfg)
    both = threading.Barrier(2, timeout=3.0)   # under the router's 5-s answer bound: a miss, not a hang
    stand_ins = [health_server(gate=both.wait) for _ in range(2)]
    servers = LocalServers(with_method(plan, cfg, get_plugin("gkd")), dict, stream=None)
    machines = Machines(servers, "127.0.0.1", 1)
    machines.finished_elsewhere = lambda machine: False
    try:
        for index, server in enumerate(stand_ins):
            machines.watched[index] = f"127.0.0.1:{server.server_address[1]}"
        for _ in range(2):   # two rounds: two misses would be a death
            machines._next_probe = 0.0
            both.reset()
            assert machines.check() is None and not servers.supervisor.missing, (servers.failure,
                                                                                 servers.supervisor.missing)
    finally:
        servers.stop()
        for server in stand_ins:
            server.shutdown()
            server.server_close()


@pytest.mark.e2e
def test_a_replica_that_did_not_start_on_machine_1_is_named_on_machine_0():
    """The exchange through a real TCPStore (standing in for torchrun's agent store): machine 1's launcher, whose
    replica failed its start, leaves the reason under the replica's key; machine 0's, waiting for that address,
    ends its job with it instead of waiting for an address that never comes."""
    from torch.distributed import TCPStore

    from dualrun.methods.plugin import get_plugin
    from dualrun.light.ports import free_port
    from dualrun.servers.local import LocalServers
    from dualrun.backends.torchrun.machine_servers import Machines

    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)   # noqa: F841 - serves the test
    machine = [LocalServers(with_method(make_plan(_cpu_cfg(2, r)), _cpu_cfg(2, r), get_plugin("gkd")), dict,
                            stream=None) for r in (0, 1)]
    Machines(machine[0], "127.0.0.1", port).share()
    Machines(machine[1], "127.0.0.1", port).not_started(
        "teacher server 1 exited with code 1 before it became healthy\n--- last lines of its log ---\nOSError: no model")
    ended = machine[0].next_death(timeout=10)   # the death event machine 0's launcher ends its job with
    assert ended is not None, "machine 0 still waits"
    assert ended.one_line() == ("teacher server 1 did not start on machine 1: teacher server 1 exited with code "
                                "1 before it became healthy"), ended.one_line()
    machine[0].stop()


@pytest.mark.e2e
def test_machine_1_names_machine_0s_router_that_stops_answering(quick_probes):
    """Through a real TCPStore: machine 1's launcher reads the router's address that machine 0 published and
    health-checks it every PROBE_EVERY_S. Once machine 0 said its ranks finished, the router's end is no failure;
    when machine 0 is gone (its store with it) and the router is silent, two misses name the router."""
    import gc

    from torch.distributed import TCPStore

    from dualrun.contract import job_store
    from dualrun.methods.plugin import get_plugin
    from dualrun.light.ports import free_port
    from dualrun.servers.local import LocalServers
    from dualrun.backends.torchrun.machine_servers import Machines

    for finished in (True, False):
        port = free_port()
        store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
        cfg = _cpu_cfg(2, 1)
        router = next(i for i, p in enumerate(make_plan(cfg).servers) if p.kind == ROUTER)
        server = health_server()
        address = f"127.0.0.1:{server.server_address[1]}"
        store.set(job_store.server_key(router), address)          # what machine 0 published
        machine1 = LocalServers(with_method(make_plan(cfg), cfg, get_plugin("gkd")), dict, stream=None)
        machines = Machines(machine1, "127.0.0.1", port)
        machines.share()
        try:
            assert eventually(lambda: machines.watched.get(router) == address, 10), machines.watched
            if finished:
                store.set(job_store.finished_key(0), "1")
            else:
                del store                                          # machine 0's agent is gone with its store
                gc.collect()
            line = _after_silence(machines, server, finished)
            assert finished or line.startswith(
                f"teacher router on machine 0 stopped answering its health check (http://{address}/router/stats: "
                "health probe: ConnectionRefusedError: "), line
            assert machine1.failure is None or machine1.failure.index == router   # the exchange itself went fine
        finally:
            machine1.stop()


@pytest.mark.e2e
def test_machine_1_restarts_only_once_the_ending_attempts_store_is_gone_or_replaced():
    """`await_attempt` against a real TCPStore: while the store is still marked with the ending attempt, machine 1
    waits; a store marked with the new attempt, or none at all, lets it start."""
    import gc
    import time

    from torch.distributed import TCPStore

    from dualrun.contract import job_store
    from dualrun.light.ports import free_port
    from dualrun.backends.torchrun.machine_servers import await_attempt

    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    store.set(job_store.ATTEMPT_KEY, "0")
    t = time.monotonic()
    await_attempt("127.0.0.1", port, 1, timeout_s=1.5)
    assert time.monotonic() - t >= 1.5                       # still attempt 0's store: waited it out
    store.set(job_store.ATTEMPT_KEY, "1")
    t = time.monotonic()
    await_attempt("127.0.0.1", port, 1, timeout_s=10)
    assert time.monotonic() - t < 5                          # machine 0's new store: go
    del store
    gc.collect()
    t = time.monotonic()
    await_attempt("127.0.0.1", port, 1, timeout_s=10)
    assert time.monotonic() - t < 2                          # no store: machine 0 is between attempts, go
