"""A Ray worker node lost mid-run on the virtual cluster (tests/support/vcluster.py): a head on machine 0 that runs no
job and a worker node on machines 1 and 2 (3 CPUs each), started by the lines of
examples/multi-node/ray-by-hand/README.md. TRL's sft.py trains with one rank on each worker node (SPREAD), saving every
2 steps, with `max_failures: 1`; once checkpoint-2 is complete, machine 2 is lost (every process of it SIGKILLed, its
raylet with them). The whole job restarts on the node that is left (both ranks there: SPREAD is a preference), resumes
from the newest complete checkpoint and ends its steps. The restart line is the error of the rank that failed first:
gloo's connection reset by the lost node's address. Every checkpoint directory is complete, and no actor or placement
group is left.

The same with machine 2's link cut instead (its port on the switch dropping every frame): Ray's control plane
declares the node dead once its health checks fail, the job restarts on the node left the same way, and once the
link is back machine 2's raylet learns it is dead and ends, with every process of the job it held.

Its own cluster: losing a node would spoil test_cluster_ray.py's."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster_jobs import ENV, sft_args, sft_data
from cluster_ray import RAY, nothing_left, ray3, table
from helpers import eventually
from doc_recipes import shell_env
from vcluster import VCluster, address

pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.slow, pytest.mark.ray]


def job_processes(vc: VCluster, machine: int) -> list[str]:
    """The processes of the job (Ray workers that ran its actors, dualrun's own) still on `machine`."""
    proc = vc.run(machine, ["ps", "-eo", "args"], timeout=30)
    return [ln for ln in proc.stdout.splitlines() if "ray::" in ln or "dualrun" in ln]


@pytest.fixture
def shared(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ray-faults")


@pytest.mark.parametrize("fault", ["lost", "cut"])
def test_a_worker_node_lost_mid_run_restarts_the_job_on_the_node_left(shared, tiny, fault):
    with ray3(shared, tiny) as vc:
        (shared / "ray.yaml").write_text("use_cpu: true\nroles: {train: {gpus: 2}}\nmax_failures: 1\n"
                                         "ray: {placement_strategy: SPREAD}\n")
        argv = sft_args(tiny, sft_data(tiny, shared), shared / "out")
        argv[argv.index("--max_steps") + 1] = "10"
        with open(shared / "launch.out", "w") as out:
            launch = vc.popen(0, [sys.executable, "-m", "dualrun", "launch", "--backend", "ray", "--config_file",
                                  "ray.yaml", *argv, "--save_steps", "2"], cwd=shared, stdout=out,
                              stderr=subprocess.STDOUT, env=shell_env(RAY_ADDRESS=RAY, **ENV))
        deadline = time.monotonic() + 240
        while not (shared / "out" / "checkpoint-2" / "trainer_state.json").exists():
            assert time.monotonic() < deadline and launch.poll() is None, (shared / "launch.out").read_text()[-3000:]
            time.sleep(0.2)
        vc.kill(2) if fault == "lost" else vc.cut(2)
        try:
            launch.wait(timeout=300)
        finally:
            if launch.poll() is None:
                launch.kill()
        out = (shared / "launch.out").read_text()
        if fault == "cut":   # machine 2 lives on, unreachable; back on the network, what it ran of the job ends
            vc.restore(2)
            assert eventually(lambda: not job_processes(vc, 2), timeout=90), job_processes(vc, 2)
        assert launch.returncode == 0, out[-5000:]
        restart = re.search(r"dualrun: train rank \d failed \(exit code 1\): (.*); restarting the job \(1/1\)\n", out)
        assert restart and (f"[{address(2)}]" in restart.group(1)   # gloo's reset, or the actor's death: the lost
                            or f"its Ray actor on node {address(2)} died" in restart.group(1)), out[-5000:]   # node
        assert "dualrun: train: 2 worker(s) placed on 1 node(s)" in out, out[-5000:]
        assert re.search(r"resuming from \S+/checkpoint-\d+", out), out[-5000:]
        assert json.loads((shared / "out" / "checkpoint-10" / "trainer_state.json").read_text())["global_step"] == 10
        assert sorted(table(vc, shared)["nodes"]) == [address(0), address(1)]
        nothing_left(vc, shared)
    dirs = sorted((shared / "out").glob("checkpoint-*"))
    assert dirs and all((d / "trainer_state.json").is_file() for d in dirs), dirs
