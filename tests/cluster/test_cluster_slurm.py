"""The SLURM recipes across two machines of the virtual cluster (tests/support/vcluster.py), each with its own address
and its own /tmp: slurmctld on machine 0, munged and slurmd on each (tests/support/slurm_helpers.py, `MachinesSlurm`),
then `sbatch --nodes=2` of examples/multi-node/slurm/{torchrun,ray}.sbatch exactly as written, submitted on machine 0,
each training a tiny model with one rank per node. Only the scripts' own knobs change (a CPU config, one process per
node, the output dir); `--gpus-per-node=0` is given to sbatch, as a user overrides #SBATCH lines. The Ray recipe's
config spreads its two ranks (`ray.placement_strategy: SPREAD`), one per node as torchrun's are. The head's
/etc/hosts is Debian's (its own name on 127.0.1.1), so its name resolves to loopback there and to its address
elsewhere. SLURM is installed when missing (root; CI), else the test is skipped with the reason."""
from __future__ import annotations

import json
import re

import pytest

from helpers import REPO
from slurm_helpers import dualrun_in_sbatch, two_node_slurm
from doc_recipes import shell_env
from vcluster import VCluster, address

pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.slow]
SLURM = REPO / "examples" / "multi-node" / "slurm"
JOB = ("raylet", "gcs_server", "default_worker.py", "-m dualrun", "dualrun.rank.bootstrap", "torch.distributed.run")


def left_on(vc: VCluster, machine: int) -> list[str]:
    """The job's processes still running on `machine` (Ray's, dualrun's, torchrun's), by their command lines."""
    return [line for line in vc.run(machine, ["ps", "-eo", "args"]).stdout.splitlines() if any(w in line for w in JOB)]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory, tiny):
    shared = tmp_path_factory.mktemp("slurm")
    with two_node_slurm(shared, tiny.parent) as cluster:
        yield cluster, shared


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


@pytest.mark.timeout(900)
def test_dualrun_on_slurm_runs_trl_sft_one_rank_per_node_with_the_losses_of_one_machine(slurm, tiny,
                                                                                         sft_one_machine):
    """`--backend slurm` inside a two-node allocation: TRL's sft.py unchanged, the two ranks one srun step (one task
    on each node, RANK from SLURM_PROCID, MASTER_ADDR the first node, whose name is loopback on itself: gloo gets
    the interface on the route to it), the losses of the same job on one machine, nothing left on either node."""
    from cluster_jobs import SFT_CONFIG, losses, sft_args, sft_data

    cluster, shared = slurm
    work = shared / "dualrun-sft"
    data = sft_data(tiny, work)
    (work / "job.yaml").write_text(SFT_CONFIG + "num_machines: 2\n")
    code, log = dualrun_in_sbatch(cluster, work, ["--config_file", "job.yaml", *sft_args(tiny, data, work / "two")])
    assert code == 0 and "job succeeded" in log, log[-6000:] + cluster.logs()
    assert losses(work / "two") == sft_one_machine
    assert [left_on(cluster.vc, k) for k in (0, 1)] == [[], []]


@pytest.mark.timeout(900)
def test_dualrun_on_slurm_serves_gkd_from_a_teacher_on_node_1(slurm, tiny, gkd_one_machine):
    """GKD with `roles.teacher.machines: [1]` and no num_machines (the allocation's two nodes: machine 1 exists only
    through them): the teacher's CPU-engine server an srun step on node 1, both ranks (one a node) scoring against it
    at node 1's name, with the losses of one machine."""
    import json

    from cluster_jobs import gkd_args, gkd_config

    cluster, shared = slurm
    work = shared / "dualrun-gkd"
    (work / "out").mkdir(parents=True)
    config = gkd_config(tiny).replace("teacher: {gpus: 2,", "teacher: {gpus: 1, machines: [1],")
    (work / "job.yaml").write_text(config)
    code, log = dualrun_in_sbatch(cluster, work, ["--config_file", "job.yaml", *gkd_args(tiny, work / "out")])
    assert code == 0 and "job succeeded" in log, log[-6000:] + cluster.logs()
    ranks = [json.loads((work / "out" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert {r["teacher_address"].rpartition(":")[0] for r in ranks} == {cluster.names[1]}, ranks
    assert [r["losses"] for r in ranks] == gkd_one_machine
    assert [left_on(cluster.vc, k) for k in (0, 1)] == [[], []]


FAILS_ON_NODE_1 = """
import os, sys, time
if os.environ["RANK"] == "1":   # the rank on node 1
    time.sleep(3)
    sys.exit(3)
time.sleep(600)
"""


@pytest.mark.timeout(600)
def test_dualrun_on_slurm_a_rank_failing_on_node_1_ends_the_job_naming_it_and_leaves_nothing(slurm):
    """One rank a node; the rank on node 1 exits 3: the job ends within seconds naming it (its exit code the
    job's), and neither node keeps a process of the job (node 0's rank, srun, the task shims)."""
    import time

    cluster, shared = slurm
    work = shared / "dualrun-fail"
    work.mkdir()
    (work / "job.yaml").write_text("use_cpu: true\nnum_machines: 2\nroles: {train: {gpus: 2}}\n")
    (work / "w.py").write_text(FAILS_ON_NODE_1)
    start = time.monotonic()
    code, log = dualrun_in_sbatch(cluster, work, ["--config_file", "job.yaml", "w.py"], timeout=300)
    took = time.monotonic() - start
    assert code != 0 and "train rank 1 failed (exit code 3)" in log, log[-4000:] + cluster.logs()
    assert took < 120, (took, log[-3000:])
    assert [left_on(cluster.vc, k) for k in (0, 1)] == [[], []]
