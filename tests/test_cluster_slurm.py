"""The SLURM recipes across two machines of the virtual cluster (tests/vcluster.py), each with its own address and
its own /tmp: slurmctld on machine 0, munged and slurmd on each (tests/slurm_helpers.py, `MachinesSlurm`), then
`sbatch --nodes=2` of examples/multi-node/slurm/{torchrun,ray}.sbatch exactly as written, submitted on machine 0,
each training a tiny model with one rank per node. Only the scripts' own knobs change (a CPU config, one process per
node, the output dir); `--gpus-per-node=0` is given to sbatch, as a user overrides #SBATCH lines. The Ray recipe's
config spreads its two ranks (`ray.placement_strategy: SPREAD`), one per node as torchrun's are. The head's
/etc/hosts is Debian's (its own name on 127.0.1.1), so its name resolves to loopback there and to its address
elsewhere. SLURM is installed when missing (root; CI), else the test is skipped with the reason."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cluster_jobs import debian_hosts
from helpers import REPO
from slurm_helpers import MachinesSlurm, ensure_installed
from test_recipes import shell_env
from vcluster import VCluster, address

pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.slow]
SLURM = REPO / "examples" / "multi-node" / "slurm"
JOB = ("raylet", "gcs_server", "default_worker.py", "-m dualrun", "dualrun.rank.bootstrap", "torch.distributed.run")


def left_on(vc: VCluster, machine: int) -> list[str]:
    """The job's processes still running on `machine` (Ray's, dualrun's, torchrun's), by their command lines."""
    return [line for line in vc.run(machine, ["ps", "-eo", "args"]).stdout.splitlines() if any(w in line for w in JOB)]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory, tiny):
    why = ensure_installed()
    if why:
        pytest.skip(why)
    shared = tmp_path_factory.mktemp("slurm")
    with VCluster(2, shared=[shared, tiny.parent]) as vc:
        debian_hosts(vc, 0)
        yield MachinesSlurm(vc, shared / "slurm").start(), shared


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", ["torchrun", "ray"])
def test_sbatch_recipe_trains_across_two_nodes(slurm, tiny, backend):
    cluster, shared = slurm
    out = shared / f"out-{backend}"
    config = shared / "sft_cpu_spread.yaml"
    config.write_text((REPO / "configs" / "sft_cpu.yaml").read_text() + "ray: {placement_strategy: SPREAD}\n")
    env = shell_env(MODEL=str(tiny / "model"), DATA=str(tiny / "data" / "sft.jsonl"), CONFIG=str(config),
                    NPROC_PER_NODE="1", GPUS_PER_NODE="0", OUT=str(out), TRAIN_ARGS="--max_steps 2")
    code, log = cluster.sbatch(SLURM / f"{backend}.sbatch", "--nodes=2", "--gpus-per-node=0", "--cpus-per-task=2",
                               env=env, cwd=REPO, timeout=800)
    assert code == 0, log[-6000:] + cluster.logs()
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 2, log[-3000:]
    if backend == "torchrun":   # one launcher per node, machine 0 the first host of the allocation
        assert log.count("job succeeded") == 2 and "node 0 vc0 (this machine)" in log, log[-3000:]
    else:                       # one launcher, on the batch host, against the Ray cluster of both nodes
        placed = re.search(r"train: 2 worker\(s\) placed on 2 node\(s\), master (\S+):\d+", log)
        assert placed and placed.group(1) in (address(0), address(1)) and "job succeeded" in log, log[-3000:]
    assert [left_on(cluster.vc, k) for k in (0, 1)] == [[], []]
