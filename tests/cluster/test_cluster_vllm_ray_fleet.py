"""GRPO with a vLLM rollout (the CPU build) whose fleet goes 1 -> 2 -> 1 mid-run on Ray across machines of the virtual
cluster (tests/support/vcluster.py), while TRL's unchanged GRPOTrainer trains: a Ray head on machine 0 with just the
CPUs of the actors started at launch (the trainer rank, the rollout's router, its first replica), `dualrun launch
--backend ray` there; at step 1 a node joins with `ray start --address HEAD` on machine 1 (one CPU: one replica)
and the fleet grows onto it (dualrun's line naming its address), the new replica taking the trainer's weights before
it serves; at step 3 that node's raylet is stopped by its pid and its replica leaves. Each machine routes out through
an interface no other machine reaches (`route_out_elsewhere`): the engine on machine 1 joins the weight-sync group
only because trainer rank 0 advertises its Ray address although the cluster had one node at launch.

The training equals the same job on a fixed fleet (the same config before any node joined: no room to grow), bit for
bit: the completions and the losses (assets/grpo_fleet_probe.py, as tests/vllm_tier/test_vllm_fleet.py compares
them on torchrun). Nothing is left: no actor or placement group, no process on machine 1, no engine on machine 0.
Runs in the cluster tier with the vLLM venv (marked `cluster` and `vllm`); one engine per machine at a time."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cluster_jobs import ENV, route_out_elsewhere
from cluster_ray import RAY, join, leave, nothing_left, processes, start_head, table
from doc_recipes import shell_env, token_mode
from helpers import ASSETS, eventually, pids_matching
from vcluster import VCluster, address
from vllm_helpers import TIER, assert_grew_as_fixed, server_role

pytestmark = [*TIER, pytest.mark.cluster, pytest.mark.ray, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm-ray-fleet")


@pytest.fixture(scope="module")
def vc(shared, vllm_tiny):
    with VCluster(2, shared=[shared, vllm_tiny.parent]) as cluster:
        route_out_elsewhere(cluster)   # vLLM's get_ip() alone would give trainer rank 0's wan0 address
        start_head(cluster, 3, shared)
        yield cluster


def start(vc: VCluster, work: Path, tiny: Path, *probe: str) -> subprocess.Popen:
    work.mkdir()
    (work / "out").mkdir()
    (work / "ray.yaml").write_text(f"use_cpu: true\nmethod: grpo\nlog_dir: {work / 'logs'}\nroles:\n"
                                   "  train: {gpus: 1}\n"
                                   + server_role("rollout", tiny / "model", gpus=1, health_timeout_s=400,
                                                 processes=True, min_replicas=1, max_replicas=2))
    with open(work / "launch.out", "w") as out:
        return vc.popen(0, [sys.executable, "-m", "dualrun", "launch", "--backend", "ray", "--config_file", "ray.yaml",
                            str(ASSETS / "grpo_fleet_probe.py"), str(tiny / "model"),
                            str(tiny / "data" / "prompts.jsonl"), str(work / "out"), *probe],
                        cwd=work, stdout=out, stderr=subprocess.STDOUT,
                        env=shell_env(RAY_ADDRESS=RAY, **ENV, **token_mode()))


def until(launch: subprocess.Popen, work: Path, what, timeout: float = 600):
    found = eventually(lambda: what() or launch.poll() is not None, timeout=timeout, every=0.5)
    assert found and launch.poll() is None, (work / "launch.out").read_text()[-5000:]
    return what()


def said(work: Path, pattern: str):
    return re.search(pattern, (work / "launch.out").read_text())


def ended(launch: subprocess.Popen, timeout: float) -> int:
    try:
        return launch.wait(timeout=timeout)
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.wait()


def engines(vc: VCluster, machine: int, marker: str) -> list[str]:
    """The job's processes still on `machine`: vLLM's (its API server, its engine core), the job's Ray workers, any
    naming the job's folder; not the head's own Ray processes (which run from .venv-vllm: a path, not vLLM)."""
    job = ("vllm", "ray::serveractor", "ray::rankworker")
    return [r for r in processes(vc, machine)
            if any(w in r.lower().replace(".venv-vllm", "") for w in job) or marker in r]


def test_a_vllm_rollout_fleet_grows_onto_a_joining_node_and_loses_it_and_trains_as_a_fixed_one(vc, shared,
                                                                                                  vllm_tiny):
    fixed = shared / "fixed"
    assert ended(start(vc, fixed, vllm_tiny, "--fixed"), 700) == 0, (fixed / "launch.out").read_text()[-5000:]
    reference = json.loads((fixed / "out" / "rank0.json").read_text())
    assert "joined at" not in (fixed / "launch.out").read_text()
    nothing_left(vc, shared)

    work = shared / "grown"
    launch = start(vc, work, vllm_tiny)
    node = None
    try:
        until(launch, work, lambda: (work / "out" / "grow_now").exists())
        node = join(vc, 1, 1, shared)
        until(launch, work, lambda: said(work, r"dualrun: rollout: the cluster has room for another replica on node "
                                               rf"{re.escape(address(1))} \(\w{{8}}\); starting one there"))
        until(launch, work, lambda: said(work, rf"dualrun: rollout server 1 joined at {re.escape(address(1))}:\d+, "
                                               r"serving"))
        until(launch, work, lambda: (work / "out" / "shrink_now").exists())
        leave(vc, 1, node, shared)
        until(launch, work, lambda: said(work, r"dualrun: rollout server 1 left \(died: rollout server 1: its node "
                                               rf"{re.escape(address(1))} \(\w{{8}}\) left the cluster .*\); 1 of "
                                               r"min 1 remain"))
        code = ended(launch, 600)
    finally:
        if launch.poll() is None:
            launch.kill()
        if node is not None and node.poll() is None:
            node.kill()
    out = (work / "launch.out").read_text()
    assert code == 0, out[-5000:]
    rec = json.loads((work / "out" / "rank0.json").read_text())
    # weights first, none stale, the same training as on a fixed fleet of one, bit for bit
    assert_grew_as_fixed(rec, reference, (work / "logs" / "rollout-server-1.log").read_text())
    nothing_left(vc, shared)
    assert eventually(lambda: not processes(vc, 1), timeout=60), processes(vc, 1)
    assert eventually(lambda: not engines(vc, 0, str(work)), timeout=60), engines(vc, 0, str(work))
    assert not pids_matching(str(work))
    assert sorted(table(vc, shared)["nodes"]) == [address(0)]
