"""Faults while training across two torchrun machines of the virtual cluster (tests/support/vcluster.py): machine 1 lost
(every process of it SIGKILLed) and machine 1's link cut (the switch drops its frames silently), each after TRL's sft.py
has saved its second checkpoint. The job ends on every machine that is left within the bound
`torchrun.machine_timeout_s` gives it (plus the agent's stop), not gloo's or HF's 30 minutes, with a line naming the
machine gone (its address) and why; nothing of the job is left on either machine, and every checkpoint directory in the
shared output is complete.

The watch alone (dualrun/backends/torchrun/machine_watch.py, no job) is tested first: it is what bounds both faults. A machine
that never comes ends the other within `torchrun.rendezvous_timeout_s`, naming it (machine 1 never started, or machine
0 not there); machine 1 started 20 s after machine 0 (within that bound) trains as if started together."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster_jobs import gkd_args, gkd_config, launch_on, left_on, sft_args, sft_data
from helpers import REPO
from vcluster import VCluster, address

pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.slow]

MAIN = address(0)
TIMEOUT_S = 10          # torchrun.machine_timeout_s of these jobs
JOIN_S = 10             # torchrun.rendezvous_timeout_s of the jobs whose other machine never comes
START_S = 30            # a launcher's start (imports, plan) before it waits, on a loaded 2-core machine
STOP_S = 45             # the agent's stop of its workers and the launcher's exit, on a loaded 2-core machine
CONFIG = f"use_cpu: true\nroles: {{train: {{gpus: 2}}}}\ntorchrun: {{machine_timeout_s: {TIMEOUT_S}}}\n"

WATCH = """
import sys, time
from datetime import timedelta
from torch.distributed import TCPStore
from dualrun.backends.torchrun.machine_watch import MachineWatch
k = int(sys.argv[1])
if k == 0:
    store = TCPStore("0.0.0.0", 29511, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
w = MachineWatch(sys.argv[2], 29511, k, 2, 4.0, lambda line: print("lost:", line, flush=True))
w.start()
while w.failure is None:
    time.sleep(0.5)
    if k == 0 and store.add("dualrun/beat/1", 0) > 0:
        print("beating", flush=True)
time.sleep(0.2)
"""


@pytest.fixture
def shared(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("faults")


def test_the_watch_names_each_side_of_a_cut_link_within_its_timeout(shared):
    (shared / "watch.py").write_text(WATCH)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with VCluster(2, shared=[shared]) as vc:
        procs = [vc.popen(k, [sys.executable, str(shared / "watch.py"), str(k), MAIN], env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) for k in (0, 1)]
        assert procs[0].stdout.readline().strip() == "beating"   # machine 1 beats once, then its link is cut
        cut = time.monotonic()
        vc.cut(1)
        outs = [p.communicate(timeout=60)[0] for p in procs]
        assert time.monotonic() - cut < 4.0 + 10, outs
    assert f"lost: machine 1 ({address(1)}) sent no sign of life for 4 s" in outs[0], outs
    assert f"lost: machine 0 ({MAIN}) did not answer for 4 s" in outs[1], outs


def sft_until_a_checkpoint(vc: VCluster, work: Path, tiny: Path) -> list[subprocess.Popen]:
    """sft.py across both machines (400 steps, a checkpoint every 2), once checkpoint-2 is complete."""
    argv = sft_args(tiny, sft_data(tiny, work), work / "out")
    argv[argv.index("--max_steps") + 1] = "400"
    procs = launch_on(vc, work, [*argv, "--save_steps", "2"], CONFIG)
    deadline = time.monotonic() + 240
    while not (work / "out" / "checkpoint-2" / "trainer_state.json").exists():
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
            [(work / f"m{k}" / "out").read_text()[-2000:] for k in (0, 1)]
        time.sleep(0.2)
    return procs


def ended(proc: subprocess.Popen, within: float, out: Path) -> str:
    try:
        proc.wait(timeout=within)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"still running {within:.0f} s after the fault: {out.read_text()[-3000:]}")
    assert proc.returncode not in (0, None), out.read_text()[-3000:]
    return out.read_text()


def complete_checkpoints(out: Path) -> None:
    dirs = sorted(out.glob("checkpoint-*"))
    assert dirs and all((d / "trainer_state.json").is_file() and (d / "model.safetensors").is_file()
                        for d in dirs), [sorted(os.listdir(d)) for d in dirs]


def test_machine_1_lost_mid_run_ends_machine_0s_job_naming_it(shared, tiny):
    with VCluster(2, shared=[shared, tiny.parent]) as vc:
        procs = sft_until_a_checkpoint(vc, shared, tiny)
        lost = time.monotonic()
        vc.kill(1)
        out = ended(procs[0], TIMEOUT_S + STOP_S, shared / "m0" / "out")
        took = time.monotonic() - lost
        assert re.search(rf"dualrun: error: machine 1 \({re.escape(address(1))}\) sent no sign of life for \d+ s", out), \
            out[-3000:]
        assert left_on(vc, 0) == []
        procs[1].wait(30)
    complete_checkpoints(shared / "out")
    assert took < TIMEOUT_S + STOP_S


def test_machine_1s_link_cut_mid_run_ends_the_job_on_both_machines_naming_the_other(shared, tiny):
    with VCluster(2, shared=[shared, tiny.parent]) as vc:
        procs = sft_until_a_checkpoint(vc, shared, tiny)
        vc.cut(1)
        outs = [ended(p, TIMEOUT_S + STOP_S, shared / f"m{k}" / "out") for k, p in enumerate(procs)]
        assert (f"dualrun: error: machine 1 ({address(1)}) sent no sign of life for {TIMEOUT_S} s "
                "(torchrun.machine_timeout_s)") in outs[0], outs[0][-3000:]
        assert f"dualrun: error: machine 0 ({MAIN}) did not answer for {TIMEOUT_S} s" in outs[1], outs[1][-3000:]
        assert left_on(vc, 0) == [] and left_on(vc, 1) == []
    complete_checkpoints(shared / "out")


def test_a_machine_that_never_comes_ends_the_other_within_the_rendezvous_timeout_naming_it(shared, tiny):
    """Machine 1 alone (machine 0 never started): it ends within `torchrun.rendezvous_timeout_s` naming machine 0 and
    its address. Then machine 0 alone (machine 1 never started): it ends within the same bound naming machine 1,
    instead of torchrun's 600 s; nothing is left on either machine."""
    config = CONFIG.replace("machine_timeout_s:", f"rendezvous_timeout_s: {JOIN_S}, machine_timeout_s:")
    argv = sft_args(tiny, sft_data(tiny, shared), shared / "out")
    with VCluster(2, shared=[shared, tiny.parent]) as vc:
        for k, other in ((1, 0), (0, 1)):
            work = shared / f"alone{k}"
            work.mkdir()
            started = time.monotonic()
            out = ended(launch_on(vc, work, argv, config, [k])[0], JOIN_S + START_S, work / f"m{k}" / "out")
            took = time.monotonic() - started
            assert took >= JOIN_S, out[-3000:]
            if k == 1:
                assert (f"dualrun: error: machine 0 ({MAIN}) did not answer within {JOIN_S} s "
                        "(torchrun.rendezvous_timeout_s") in out, out[-3000:]
            else:
                assert (f"dualrun: error: machine 1 did not join within {JOIN_S} s (torchrun.rendezvous_timeout_s)"
                        in out), out[-3000:]
            assert "Traceback" not in out and left_on(vc, k) == [], out[-3000:]
    assert not (shared / "out").exists()


def test_machine_1_started_late_within_the_rendezvous_wait_trains_normally(shared, tiny):
    """Machine 1's launch 20 s after machine 0's, within `torchrun.rendezvous_timeout_s` (40 s here): the job trains
    its 3 steps on both machines, and machine 0's watch, which judges only machines that have written once, does
    not take the late one for lost."""
    argv = sft_args(tiny, sft_data(tiny, shared), shared / "out")
    config = CONFIG.replace("machine_timeout_s:", "rendezvous_timeout_s: 40, machine_timeout_s:")
    with VCluster(2, shared=[shared, tiny.parent]) as vc:
        first = launch_on(vc, shared, argv, config, [0])[0]
        time.sleep(20)
        assert first.poll() is None
        second = launch_on(vc, shared, argv, config, [1])[0]
        outs = []
        for k, p in ((0, first), (1, second)):
            p.wait(timeout=240)
            outs.append((shared / f"m{k}" / "out").read_text())
        assert [first.returncode, second.returncode] == [0, 0], [o[-3000:] for o in outs]
        assert all("job succeeded" in o for o in outs) and "sign of life" not in outs[0]
        assert left_on(vc, 0) == [] and left_on(vc, 1) == []
    assert (shared / "out" / "model.safetensors").exists()


def test_a_teacher_replica_on_a_lost_machine_ends_the_job_naming_it_within_the_health_checks(shared, tiny):
    """GKD with a teacher replica on each machine behind machine 0's router; both trainers hold after step 1 (no
    collective in flight), then machine 1 is lost. Machine 0's health check of machine 1's replica (about once a
    second, two misses) ends the job naming the replica, its machine and its address, well before the machine watch
    would; nothing is left on machine 0 (its router and replica included)."""
    hold = shared / "hold"
    hold.touch()
    config = gkd_config(tiny, f"torchrun: {{gpus_per_machine: 2, machine_timeout_s: {TIMEOUT_S}}}\n"
                              f"log_dir: {shared / 'logsMACHINE'}\n")
    argv = [*gkd_args(tiny, shared / "out"), "--max_steps", "4", "--hold_file", str(hold)]
    with VCluster(2, shared=[shared, tiny.parent]) as vc:
        procs = launch_on(vc, shared, argv, config)
        deadline = time.monotonic() + 240
        while not all((shared / f"hold.held{r}").exists() for r in (0, 1)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                [(shared / f"m{k}" / "out").read_text()[-2000:] for k in (0, 1)]
            time.sleep(0.2)
        lost = time.monotonic()
        vc.kill(1)
        out = ended(procs[0], STOP_S, shared / "m0" / "out")
        took = time.monotonic() - lost
        assert re.search(rf"dualrun: error: teacher server 1 on machine 1 stopped answering its health check "
                         rf"\(http://{re.escape(address(1))}:\d+/", out), out[-3000:]
        assert "sign of life" not in out and left_on(vc, 0) == []
        procs[1].wait(30)
    assert took < STOP_S
