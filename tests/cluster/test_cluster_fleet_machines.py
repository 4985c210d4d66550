"""An optional serving machine on the virtual cluster (tests/support/vcluster.py), each machine at its own address:
both trainer ranks, teacher replica 0 and the router on machine 0; teacher replica 1 alone on machine 1, above
`min_replicas` (plan/optional.py). Machine 0 starts alone; machine 1 is launched once the trainers hold after step 1
and joins. Then either it is SIGTERMed after step 2 (machine 0 drains its replica, it exits 0), or its link is cut
while the trainers hold (machine 0's health checks lose its replica, which leaves: the job goes on). Either way GKD
ends 0 with the losses of the same job on one machine, and nothing is left on either machine."""
from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest

from cluster_jobs import all_ended, gkd_args, gkd_config, gkd_losses, launch_on, left_on, outputs
from vcluster import VCluster, address

pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(700)]

WAIT_S = 300


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fleet-machines")


def layout(tiny: Path, work: Path) -> str:
    return gkd_config(tiny, f"log_dir: {work / 'logsMACHINE'}\ntorchrun: {{gpus_per_machine: 3, machine_timeout_s: 6}}"
                      "\n").replace("train: {gpus: 2}", "train: {gpus: 2, machines: [0]}").replace(
        "teacher: {gpus: 2,", "teacher: {gpus: 1, max_replicas: 2,")


def _until(check, procs, work: Path, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
            [o[-2000:] for o in outputs(work, range(len(procs)))]
        time.sleep(0.2)


def _held(work: Path, step: int) -> bool:
    return all((work / f"gate.{step}.held{r}").exists() for r in (0, 1))


def _joined(vc: VCluster, work: Path, tiny: Path) -> list:
    """Machine 0 alone until the trainers hold after step 1, then machine 1, until machine 0 took its replica in."""
    for step in (1, 2):
        (work / f"gate.{step}").touch()
    argv = [*gkd_args(tiny, work / "out"), "--hold_file", str(work / "gate"), "--hold_steps", "1,2"]
    procs = launch_on(vc, work, argv, layout(tiny, work), machines=(0,))
    _until(lambda: _held(work, 1), procs, work)
    procs += launch_on(vc, work, argv, layout(tiny, work), machines=(1,))
    _until(lambda: re.search(rf"teacher server 1 joined at {re.escape(address(1))}:\d+ with machine 1",
                             (work / "m0" / "out").read_text()), procs, work)
    return procs


def test_joins_late_then_sigterm_drains_it_with_the_losses_of_one_machine(shared, tiny, gkd_one_machine):
    work = shared / "sigterm"
    work.mkdir()
    with VCluster(2, shared=[shared, tiny.parent]) as vc:
        procs = _joined(vc, work, tiny)
        (work / "gate.1").unlink()   # step 2 on both replicas
        _until(lambda: _held(work, 2), procs, work)
        assert '"POST /v1/completions' in (work / "logs1" / "teacher-server-1.log").read_text()
        procs[1].send_signal(signal.SIGTERM)
        all_ended(procs[1:], work, 90)
        (work / "gate.2").unlink()
        outs = all_ended(procs, work, WAIT_S)
        assert [p.returncode for p in procs] == [0, 0], [o[-3000:] for o in outs]
        assert "teacher server 1 left (machine 1 stopped by SIGTERM; drained); 1 of min 1 remain" in outs[0]
        assert "dualrun: machine 1 left the job (SIGTERM)" in outs[1], outs[1][-2000:]
        assert [gkd_losses(work / "out", r) for r in (0, 1)] == gkd_one_machine
        assert left_on(vc, 0) == [] and left_on(vc, 1) == []


def test_joins_late_then_its_link_is_cut_and_the_job_goes_on_with_the_losses_of_one_machine(shared, tiny,
                                                                                            gkd_one_machine):
    work = shared / "cut"
    work.mkdir()
    with VCluster(2, shared=[shared, tiny.parent]) as vc:
        procs = _joined(vc, work, tiny)
        vc.cut(1)
        _until(lambda: "dualrun: teacher server 1 left (died: teacher server 1 on machine 1 stopped answering its "
                       "health check" in (work / "m0" / "out").read_text(), procs[:1], work, 60)
        for step in (1, 2):
            (work / f"gate.{step}").unlink()
        outs = all_ended(procs, work, WAIT_S)
        assert procs[0].returncode == 0, outs[0][-3000:]
        assert "1 of min 1 remain" in outs[0]
        assert procs[1].returncode != 0 and re.search(   # cut off: machine 1 ends, naming machine 0 (whichever look
            rf"dualrun: error: (machine 0 \({re.escape(address(0))}\) did not answer for 6 s|teacher router on "
            r"machine 0 stopped answering its health check)", outs[1]), outs[1][-2000:]   # finds the silence first)
        assert [gkd_losses(work / "out", r) for r in (0, 1)] == gkd_one_machine
        vc.restore(1)
        assert left_on(vc, 0) == [] and left_on(vc, 1) == []
