"""Servers start beside the trainers on several torchrun machines too: two `dualrun launch` machines on one host
(127.0.0.1), a GKD teacher with a replica on each behind machine 0's router, a stand-in trainer that asks the
router's /health every step. Machine 1's replica loads slowly (its machine's config alone asks for it): machine
0's ranks run meanwhile and wait for the router where they first use it. Machine 1's replica never answers within
its `health_timeout_s`: both machines end, naming it, never restarted, no process left on either."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import ASSETS, eventually, link_tiny, pids_matching

STEPS = 3


def _two_machines(tmp_path: Path, tiny: Path, machine_1_teacher: str) -> list[subprocess.Popen]:
    """Both machines' launchers (stderr in m{rank}/err), each with its own config: the same job, machine 1's teacher
    with `machine_1_teacher` (more teacher keys) too: each machine starts only its own servers from it."""
    from dualrun.light.ports import free_port

    port = free_port()
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "dualrun", "launch", "--config_file", "job.yaml", "--num_machines", "2",
           "--machine_rank", "{rank}", "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
           str(ASSETS / "uses_teacher.py"), str(out), str(STEPS), "none"]
    procs = []
    for rank in (0, 1):
        here = tmp_path / f"m{rank}"
        here.mkdir()
        more = machine_1_teacher if rank == 1 else ""
        (here / "job.yaml").write_text(
            "use_cpu: true\nmethod: gkd\nmax_failures: 1\ntorchrun: {gpus_per_machine: 2}\nroles:\n"
            f"  train: {{gpus: 2}}\n  teacher: {{gpus: 2, model: {tiny / 'teacher'}, top_k: 5, {more}}}\n"
            f"log_dir: {tmp_path / f'logs{rank}'}\n")
        with open(here / "err", "w") as err:
            procs.append(subprocess.Popen([c.format(rank=rank) for c in cmd], cwd=here, env=dict(os.environ),
                                          stdout=subprocess.DEVNULL, stderr=err, text=True))
    return procs


def _ended(tmp_path: Path, procs: list[subprocess.Popen], timeout_s: float) -> list[str]:
    """Wait for both machines (what is left after `timeout_s` is killed); their stderr."""
    from cluster_jobs import wait_all

    wait_all(procs, timeout_s)
    return [(tmp_path / f"m{r}" / "err").read_text() for r in (0, 1)]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_machine_0s_ranks_wait_at_first_use_for_machine_1s_slow_replica(tmp_path, module_tiny):
    tiny = link_tiny(module_tiny, tmp_path)   # the teacher's path under this test's directory marks its servers
    procs = _two_machines(tmp_path, tiny, "health_timeout_s: 120, server_args: [--startup-delay, 10]")
    errs = _ended(tmp_path, procs, 270)
    assert [p.returncode for p in procs] == [0, 0], [e[-3000:] for e in errs]
    address = json.loads((tmp_path / "out" / "address_0_0.json").read_text())
    assert all(json.loads((tmp_path / "out" / f"address_0_{r}.json").read_text()) == address for r in (0, 1))
    zero, one = errs
    starting = zero.index(f"dualrun: teacher: server starting at {address}; the trainers start beside it")
    waiting = zero.index(f"dualrun: waiting for the teacher server at {address}, which starts beside the trainers")
    healthy = zero.index(f"dualrun: teacher: server healthy at {address} (started in ")
    assert starting < waiting < healthy, zero[-3000:]   # rank 0 reached its first use before the router answered
    handed = re.search(r"dualrun: teacher server 1: server starting at (127\.0\.0\.1:\d+) \(machine 1\), handed to "
                       r"machine 0", one)
    assert handed and re.search(rf"dualrun: teacher server 1: server healthy at {handed.group(1)} \(machine 1\); "
                                r"started in \d+\.\d s", one), one[-3000:]
    router_log = (tmp_path / "logs0" / "teacher-router.log").read_text()
    assert f"for 2 replicas: 127.0.0.1:" in router_log and handed.group(1) in router_log, router_log
    assert sorted(p.name for p in (tmp_path / "out").glob("step_*")) == [f"step_{r}_{s}" for r in (0, 1)
                                                                         for s in range(STEPS)]
    assert "restarting" not in zero + one
    assert eventually(lambda: not pids_matching(str(tiny / "teacher")))


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_replica_on_machine_1_that_never_answers_ends_both_machines_naming_it(tmp_path, module_tiny):
    """`max_failures: 1` is not spent on it: nothing to restart. Machine 1 names its replica's timeout; machine 0,
    whose ranks were running and waiting for the router, names the same replica on machine 1; no rank, replica or
    router is left on either."""
    tiny = link_tiny(module_tiny, tmp_path)
    t0 = time.monotonic()
    procs = _two_machines(tmp_path, tiny, "health_timeout_s: 25, server_args: [--startup-delay, 150]")
    errs = _ended(tmp_path, procs, 200)
    took = time.monotonic() - t0
    assert [p.returncode for p in procs] == [1, 1], [e[-3000:] for e in errs]
    zero, one = errs
    assert "teacher server 1 did not become healthy within 25 s" in one, one[-3000:]
    assert "teacher server 1 did not start on machine 1: teacher server 1 did not become healthy within 25 s" \
        in zero, zero[-3000:]
    assert "dualrun: waiting for the teacher server" in zero   # machine 0's ranks ran beside the start
    assert "restarting" not in zero + one, (zero[-2000:], one[-2000:])
    assert took < 25 + 60, f"{took:.1f} s"   # the bound, then the ranks' and the servers' stop on a loaded machine
    assert not list((tmp_path / "out").glob("step_*"))
    out = str(tmp_path / "out")
    assert eventually(lambda: not pids_matching(out) and not pids_matching(str(tiny / "teacher"))), \
        pids_matching(str(tmp_path))
