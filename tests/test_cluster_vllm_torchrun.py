"""GRPO with a real vLLM rollout (the CPU build) across two torchrun machines of the virtual cluster, each with its
own address: one trainer rank per machine, the rollout's engine on machine 1 (`roles.rollout.machines: [1]`),
`dualrun launch` by hand on each machine (the accelerate recipe). Each machine routes out through an interface no
other machine reaches (`route_out_elsewhere`), as nodes with a second network do. The weight-sync group crosses the
link: trainer rank 0 on machine 0 is its master at machine 0's address on the cluster's network (dualrun's
VLLM_HOST_IP; vLLM's get_ip() alone gives the route-out address), the engine on machine 1 joins it, and every sync lands
(the engine serves the trainer's weights at every step); the job samples, rewards and trains bit for bit as the
same job on one machine. Runs in the cluster tier with the vLLM venv (marked `cluster` and `vllm`)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from cluster_jobs import launch_on, route_out_elsewhere
from helpers import ASSETS, dualrun, eventually, pids_matching
from vcluster import VCluster, address
from vllm_helpers import TIER, assert_every_sync_landed, server_role

pytestmark = [*TIER, pytest.mark.cluster, pytest.mark.timeout(900)]

ENV = {"TRL_EXPERIMENTAL_SILENCE": "1", "HF_HUB_OFFLINE": "1"}


def config(tiny: Path, extra: str = "", machines: str = "") -> str:
    return (f"use_cpu: true\nmethod: grpo\nroles:\n  train: {{gpus: 2}}\n"
            + server_role("rollout", tiny / "model", gpus=1, health_timeout_s=400, **({"machines": machines}
                                                                                       if machines else {}))
            + extra)


def probe(tiny: Path, out: Path) -> list[str]:
    """The GRPO probe (GRPOTrainer, 4 steps, each sync checked; with two ranks, rank 0 records)."""
    return [str(ASSETS / "grpo_server_probe.py"), str(tiny / "model"), str(tiny / "data" / "prompts.jsonl"), str(out)]


@pytest.fixture(scope="module")
def one_machine(tmp_path_factory, vllm_tiny) -> dict:
    """The same job on one machine (two ranks, the engine beside them): rank 0's record."""
    work = tmp_path_factory.mktemp("grpo-one-machine")
    (work / "job.yaml").write_text(config(vllm_tiny))
    proc = dualrun("launch", "--config_file", "job.yaml", *probe(vllm_tiny, work / "out"), cwd=work, env=ENV,
                   timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((work / "out" / "rank0.json").read_text())


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shared")


@pytest.fixture(scope="module")
def vc(shared, vllm_tiny):
    with VCluster(2, shared=[shared, vllm_tiny.parent]) as cluster:
        route_out_elsewhere(cluster)   # vLLM's get_ip() alone would give trainer rank 0's wan0 address
        yield cluster


def test_grpo_syncs_into_a_vllm_rollout_on_machine_1_with_the_training_of_one_machine(vc, shared, vllm_tiny,
                                                                                        one_machine):
    work = shared / "grpo"
    work.mkdir()
    out = work / "out"
    procs = launch_on(vc, work, probe(vllm_tiny, out), config(vllm_tiny, f"log_dir: {work / 'logsMACHINE'}\n",
                                                             machines="[1]"), env=ENV)
    deadline = time.monotonic() + 700
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outs = [(work / f"m{k}" / "out").read_text() for k in (0, 1)]
    assert [p.returncode for p in procs] == [0, 0], [o[-3000:] for o in outs]
    rec = json.loads((out / "rank0.json").read_text())
    server_log = (work / "logs1" / "rollout-server-0.log").read_text()
    group_port = rec["grpo"]["vllm_group_port"]
    # the engine on machine 1 joined trainer rank 0's group at machine 0's address, across the link
    assert f"dualrun gloo weight transfer: rank 1 of 2 (trainer at {address(0)}:{group_port})" in server_log, \
        server_log[-3000:]
    assert rec["grpo"]["vllm_server_host"] == address(1), rec["grpo"]   # the trainers reach it at machine 1's address
    assert not (work / "logs0" / "rollout-server-0.log").exists()
    assert_every_sync_landed(rec, replicas=1)
    same = ("generations", "rewards", "losses")   # sampled, scored, trained on: equal, not close
    assert {k: rec[k] for k in same} == {k: one_machine[k] for k in same}
    assert eventually(lambda: not pids_matching(str(vllm_tiny / "model"))), pids_matching(str(vllm_tiny / "model"))
