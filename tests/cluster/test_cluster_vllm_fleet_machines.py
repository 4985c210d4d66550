"""GRPO with a vLLM rollout (the CPU build) whose fleet goes 1 -> 2 -> 1 mid-run on two torchrun machines of the
virtual cluster (tests/support/vcluster.py), each at its own address, while TRL's unchanged GRPOTrainer trains: the
trainer rank, rollout replica 0 and the router on machine 0; replica 1 alone on machine 1, above `min_replicas`
(plan/optional.py: an optional serving machine). Machine 0 starts alone; machine 1 is launched when the probe
(assets/grpo_fleet_probe.py) asks for growth at step 1, joins, takes the trainer's weights before it serves, and is
SIGTERMed when the probe asks for the shrink at step 3 (machine 0 drains its replica; it exits 0). Each machine routes
out through an interface no other machine reaches (`route_out_elsewhere`): the engine on machine 1 joins the
weight-sync group at machine 0's address on the cluster's network.

The training equals the same job with machine 1 never launched (a fleet of one), bit for bit: the completions and
the losses. Nothing is left on either machine. Runs in the cluster tier with the vLLM venv (marked `cluster` and
`vllm`); one engine per machine at a time."""
from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest

from cluster_jobs import all_ended, launch_on, left_on, outputs, route_out_elsewhere
from helpers import ASSETS, pids_matching
from vcluster import VCluster, address
from vllm_helpers import TIER, assert_grew_as_fixed, server_role

pytestmark = [*TIER, pytest.mark.cluster, pytest.mark.timeout(1500)]

WAIT_S = 600


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm-fleet-machines")


@pytest.fixture(scope="module")
def vc(shared, vllm_tiny):
    with VCluster(2, shared=[shared, vllm_tiny.parent]) as cluster:
        route_out_elsewhere(cluster)   # vLLM's get_ip() alone would give trainer rank 0's wan0 address
        yield cluster


def layout(tiny: Path, work: Path) -> str:
    return (f"use_cpu: true\nmethod: grpo\nlog_dir: {work / 'logsMACHINE'}\n"
            "torchrun: {gpus_per_machine: 2, machine_timeout_s: 6}\nroles:\n  train: {gpus: 1, machines: [0]}\n"
            + server_role("rollout", tiny / "model", gpus=1, health_timeout_s=400, processes=True, min_replicas=1,
                          max_replicas=2))


def probe(tiny: Path, out: Path, *more: str) -> list[str]:
    return [str(ASSETS / "grpo_fleet_probe.py"), str(tiny / "model"), str(tiny / "data" / "prompts.jsonl"), str(out),
            *more]


def _until(check, procs, work: Path, timeout: float = WAIT_S):
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
            [o[-3000:] for o in outputs(work, range(len(procs)))]
        time.sleep(0.5)
    return found


def test_a_vllm_rollout_grows_onto_a_machine_launched_late_and_sigterm_drains_it_training_as_a_fixed_fleet(
        vc, shared, vllm_tiny):
    fixed = shared / "fixed"   # machine 1 never launched: a fleet of one
    (fixed / "out").mkdir(parents=True)
    procs = launch_on(vc, fixed, probe(vllm_tiny, fixed / "out", "--fixed"), layout(vllm_tiny, fixed), machines=(0,))
    outs = all_ended(procs, fixed, 700)
    assert procs[0].returncode == 0, outs[0][-5000:]
    assert "joined at" not in outs[0]
    reference = json.loads((fixed / "out" / "rank0.json").read_text())
    assert left_on(vc, 0) == [] and left_on(vc, 1) == []

    work = shared / "grown"
    (work / "out").mkdir(parents=True)
    argv = probe(vllm_tiny, work / "out")
    procs = launch_on(vc, work, argv, layout(vllm_tiny, work), machines=(0,))
    try:
        _until(lambda: (work / "out" / "grow_now").exists(), procs, work)
        procs += launch_on(vc, work, argv, layout(vllm_tiny, work), machines=(1,))
        joined = _until(lambda: re.search(rf"dualrun: rollout server 1 joined at {re.escape(address(1))}:\d+ with "
                                          r"machine 1, serving from step (\d+)", (work / "m0" / "out").read_text()),
                        procs, work)
        assert joined.group(1) == "1", joined.group(0)   # it took the trainer's weights at step 1's sync
        _until(lambda: (work / "out" / "shrink_now").exists(), procs, work)
        procs[1].send_signal(signal.SIGTERM)
        all_ended(procs[1:], work, 120)
        outs = all_ended(procs, work, WAIT_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], [o[-3000:] for o in outs]
    assert "dualrun: rollout server 1 left (machine 1 stopped by SIGTERM; drained); 1 of min 1 remain" in outs[0]
    assert "dualrun: machine 1 left the job (SIGTERM)" in outs[1], outs[1][-2000:]
    rec = json.loads((work / "out" / "rank0.json").read_text())
    # weights first, none stale, the same training as on a fixed fleet of one, bit for bit
    assert_grew_as_fixed(rec, reference, (work / "logs1" / "rollout-server-1.log").read_text())
    assert left_on(vc, 0) == [] and left_on(vc, 1) == []
    assert not pids_matching(str(work))
