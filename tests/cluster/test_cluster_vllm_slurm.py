"""GRPO with a real vLLM rollout (the CPU build) under `dualrun launch --backend slurm`, inside a two-node SLURM
allocation on the virtual cluster (tests/support/slurm_helpers.py `MachinesSlurm`): both trainer ranks one srun step on
node 0 (`roles.train.machines: [0]`), the rollout's engine an srun step alone on node 1 (`roles.rollout.machines:
[1]`), each node routing out through an interface no other node reaches (`route_out_elsewhere`). The weight-sync
group crosses the link (trainer rank 0 advertises its node's address on the cluster's network: the srun task sets
VLLM_HOST_IP), every sync lands, and the job samples, rewards and trains bit for bit as the same job on one machine.
Runs in the cluster tier with the vLLM venv (marked `cluster` and `vllm`); skipped where SLURM cannot be installed."""
from __future__ import annotations

import json

import pytest

from cluster_jobs import ENV
from slurm_helpers import dualrun_in_sbatch, two_node_slurm
from vllm_helpers import (TIER, assert_every_sync_landed, two_rank_grpo_config, two_rank_grpo_one_machine,
                          two_rank_grpo_probe)

pytestmark = [*TIER, pytest.mark.cluster, pytest.mark.timeout(900)]

JOB = ("-m dualrun", "dualrun.rank.bootstrap", "vllm.entrypoints", "VLLM::")


@pytest.fixture(scope="module")
def one_machine(tmp_path_factory, vllm_tiny) -> dict:
    """The same job on one machine (torchrun, two ranks, the engine beside them): rank 0's record."""
    return two_rank_grpo_one_machine(tmp_path_factory.mktemp("grpo-one-machine"), vllm_tiny, ENV)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory, vllm_tiny):
    shared = tmp_path_factory.mktemp("slurm-vllm")
    with two_node_slurm(shared, vllm_tiny.parent, routed_out=True) as cluster:
        yield cluster, shared


def test_grpo_on_slurm_with_the_rollout_alone_on_node_1_trains_as_one_machine(slurm, vllm_tiny, one_machine):
    cluster, shared = slurm
    work = shared / "grpo"
    work.mkdir()
    out = work / "out"
    (work / "job.yaml").write_text(two_rank_grpo_config(vllm_tiny, f"num_machines: 2\nlog_dir: {work / 'logs'}\n",
                                                        "[0]", "[1]"))
    code, log = dualrun_in_sbatch(cluster, work, ["--config_file", "job.yaml", *two_rank_grpo_probe(vllm_tiny, out)],
                                  tasks_per_node=2)
    assert code == 0 and "job succeeded" in log, log[-6000:] + cluster.logs()
    rec = json.loads((out / "rank0.json").read_text())
    assert rec["grpo"]["vllm_server_host"] == cluster.names[1], rec["grpo"]   # the trainers reach node 1's engine
    server_log = (work / "logs" / "rollout-server-0.log").read_text()
    assert "dualrun gloo weight transfer: rank 1 of 2 (trainer at " + cluster.addresses[0] in server_log, \
        server_log[-3000:]
    assert_every_sync_landed(rec, replicas=1)
    same = ("generations", "rewards", "losses")
    assert {k: rec[k] for k in same} == {k: one_machine[k] for k in same}
    left = [[line for line in cluster.vc.run(k, ["ps", "-eo", "args"]).stdout.splitlines()
             if any(w in line for w in JOB) and "ps -eo" not in line] for k in (0, 1)]
    assert left == [[], []], left
