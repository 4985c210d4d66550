"""GRPO with a real vLLM rollout (the CPU build) across two torchrun machines of the virtual cluster, each with its
own address, in the layout TRL's docs teach (`trl vllm-serve` on one node, training on another): both trainer ranks
on machine 0 (`roles.train.machines: [0]`), the rollout's engine alone on machine 1 (`roles.rollout.machines: [1]`),
`dualrun launch` by hand on each machine (the accelerate recipe); machine 1's launcher runs no torchrun agent. Each
machine routes out through an interface no other machine reaches (`route_out_elsewhere`), as nodes with a second
network do. The weight-sync group crosses the link: trainer rank 0 is its master at machine 0's address on the
cluster's network (dualrun's VLLM_HOST_IP; vLLM's get_ip() alone gives the route-out address), the engine on machine 1
joins it, and every sync lands (the engine serves the trainer's weights at every step); the job samples, rewards and
trains bit for bit as the same job on one machine (the probe, assets/grpo_server_probe.py, records on rank 0, which
alone holds TRL's vLLM client). Runs in the cluster tier with the vLLM venv (marked `cluster` and `vllm`)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cluster_jobs import launch_on, outputs, route_out_elsewhere, wait_all
from helpers import pids_matching
from vcluster import VCluster, address
from vllm_helpers import (TIER, assert_every_sync_landed, two_rank_grpo_config, two_rank_grpo_one_machine,
                          two_rank_grpo_probe)

pytestmark = [*TIER, pytest.mark.cluster, pytest.mark.timeout(900)]

ENV = {"TRL_EXPERIMENTAL_SILENCE": "1", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def one_machine(tmp_path_factory, vllm_tiny) -> dict:
    """The same job on one machine (two ranks, the engine beside them): rank 0's record."""
    return two_rank_grpo_one_machine(tmp_path_factory.mktemp("grpo-one-machine"), vllm_tiny, ENV)


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shared")


@pytest.fixture(scope="module")
def vc(shared, vllm_tiny):
    with VCluster(2, shared=[shared, vllm_tiny.parent]) as cluster:
        route_out_elsewhere(cluster)   # vLLM's get_ip() alone would give trainer rank 0's wan0 address
        yield cluster


def test_grpo_rollout_alone_on_machine_1_syncs_every_step_and_trains_as_one_machine(vc, shared, vllm_tiny,
                                                                                      one_machine):
    work = shared / "grpo"
    work.mkdir()
    out = work / "out"
    job = two_rank_grpo_config(vllm_tiny, f"log_dir: {work / 'logsMACHINE'}\n", trainers="[0]", rollout="[1]")
    procs = launch_on(vc, work, two_rank_grpo_probe(vllm_tiny, out), job, env=ENV)
    wait_all(procs, 700)
    outs = outputs(work)
    assert [p.returncode for p in procs] == [0, 0], [o[-3000:] for o in outs]
    left = [vc.run(k, ["ps", "-eo", "pid,args"], check=True).stdout.strip().splitlines()[1:] for k in (0, 1)]
    assert [[r for r in rows if r.split(None, 1)[0] != "1" and "ps -eo" not in r] for rows in left] == [[], []]
    served = re.search(r"rollout server 0: server healthy at ([\d.]+):(\d+) \(machine 1\)", outs[1])
    assert served and served.group(1) == address(1), outs[1][-3000:]
    assert "torch.distributed.run" not in outs[1] and "job succeeded" in outs[1]   # machine 1 only serves
    rec = json.loads((out / "rank0.json").read_text())
    # the engine on machine 1 joined trainer rank 0's group at machine 0's address, across the link
    server_log = (work / "logs1" / "rollout-server-0.log").read_text()
    assert (f"dualrun gloo weight transfer: rank 1 of 2 (trainer at {address(0)}:{rec['grpo']['vllm_group_port']})"
            in server_log), server_log[-3000:]
    assert rec["grpo"]["vllm_server_host"] == address(1), rec["grpo"]   # the trainers reach it at machine 1's address
    assert_every_sync_landed(rec, replicas=1)
    same = ("generations", "rewards", "losses")   # sampled, scored, trained on: equal, not close
    assert {k: rec[k] for k in same} == {k: one_machine[k] for k in same}
    assert [c["trainer_greedy"] for c in rec["checks"]] == [c["trainer_greedy"] for c in one_machine["checks"]]
    assert not pids_matching(str(work))


BOUND_S = 20


def test_a_group_that_cannot_form_across_machines_ends_within_its_bound_naming_both_ends(vc, shared, vllm_tiny):
    """The engine on machine 1 answers HTTP, but trainer rank 0 advertises an address machine 1 has no route to
    (VLLM_HOST_IP 192.0.2.1, as an interface or a filter between the machines would): both machines end within
    `weight_sync_timeout_s` (and the trainer's model load) instead of 600 s twice, trainer rank 0's error names its
    address and port and the rollout server on machine 1, and nothing is left on either machine."""
    import time

    work = shared / "grpo-unformed"
    work.mkdir()
    job = two_rank_grpo_config(vllm_tiny, f"log_dir: {work / 'logsMACHINE'}\nweight_sync_timeout_s: {BOUND_S}\n",
                 trainers="[0]", rollout="[1]")
    job = job.replace("train: {gpus: 2, machines: [0]}",
                      "train: {gpus: 2, machines: [0], env: {VLLM_HOST_IP: 192.0.2.1}}")
    assert "VLLM_HOST_IP" in job
    started = time.monotonic()
    procs = launch_on(vc, work, two_rank_grpo_probe(vllm_tiny, work / "out"), job, env=ENV)
    wait_all(procs, 600)
    took = time.monotonic() - started
    outs = outputs(work)
    assert procs[0].returncode == 1 and procs[1].returncode != 0, [o[-3000:] for o in outs]
    served = re.search(r"rollout server 0: server healthy at ([\d.]+:\d+) \(machine 1\)", outs[1])
    assert served and served.group(1).startswith(address(1) + ":"), outs[1][-3000:]
    assert re.search(rf"GroupNotFormed: the weight-sync group did not form within {BOUND_S} s "
                     rf"\(weight_sync_timeout_s\): trainer rank 0 at 192\.0\.2\.1:\d+ and the rollout server at "
                     rf"http://{re.escape(served.group(1))}", outs[0]), outs[0][-4000:]
    assert took < 400 + BOUND_S + 120, took   # the server's start (health_timeout_s 400 at most), the bound, teardown
    left = [vc.run(k, ["ps", "-eo", "pid,args"], check=True).stdout.strip().splitlines()[1:] for k in (0, 1)]
    assert [[r for r in rows if r.split(None, 1)[0] != "1" and "ps -eo" not in r] for rows in left] == [[], []]
