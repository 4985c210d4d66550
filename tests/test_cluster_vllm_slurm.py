"""GRPO with a real vLLM rollout (the CPU build) under `dualrun launch --backend slurm`, inside a two-node SLURM
allocation on the virtual cluster (tests/slurm_helpers.py `MachinesSlurm`): both trainer ranks one srun step on
node 0 (`roles.train.machines: [0]`), the rollout's engine an srun step alone on node 1 (`roles.rollout.machines:
[1]`), each node routing out through an interface no other node reaches (`route_out_elsewhere`). The weight-sync
group crosses the link (trainer rank 0 advertises its node's address on the cluster's network: the srun task sets
VLLM_HOST_IP), every sync lands, and the job samples, rewards and trains bit for bit as the same job on one machine.
Runs in the cluster tier with the vLLM venv (marked `cluster` and `vllm`); skipped where SLURM cannot be installed."""
from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

from cluster_jobs import debian_hosts, route_out_elsewhere
from helpers import ASSETS, dualrun
from slurm_helpers import MachinesSlurm, ensure_installed
from vcluster import VCluster
from vllm_helpers import TIER, assert_every_sync_landed, server_role

pytestmark = [*TIER, pytest.mark.cluster, pytest.mark.timeout(900)]

ENV = {"TRL_EXPERIMENTAL_SILENCE": "1", "HF_HUB_OFFLINE": "1"}
JOB = ("-m dualrun", "dualrun.rank.bootstrap", "vllm.entrypoints", "VLLM::")


def config(tiny: Path, trainers: str = "", rollout: str = "", extra: str = "") -> str:
    train = f"{{gpus: 2, machines: {trainers}}}" if trainers else "{gpus: 2}"
    return (f"use_cpu: true\nmethod: grpo\nroles:\n  train: {train}\n"
            + server_role("rollout", tiny / "model", gpus=1, health_timeout_s=400,
                          **({"machines": rollout} if rollout else {})) + extra)


def probe(tiny: Path, out: Path) -> list[str]:
    return [str(ASSETS / "grpo_server_probe.py"), str(tiny / "model"), str(tiny / "data" / "prompts.jsonl"), str(out)]


@pytest.fixture(scope="module")
def one_machine(tmp_path_factory, vllm_tiny) -> dict:
    """The same job on one machine (torchrun, two ranks, the engine beside them): rank 0's record."""
    work = tmp_path_factory.mktemp("grpo-one-machine")
    (work / "job.yaml").write_text(config(vllm_tiny))
    proc = dualrun("launch", "--config_file", "job.yaml", *probe(vllm_tiny, work / "out"), cwd=work, env=ENV,
                   timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((work / "out" / "rank0.json").read_text())


@pytest.fixture(scope="module")
def slurm(tmp_path_factory, vllm_tiny):
    why = ensure_installed()
    if why:
        pytest.skip(why)
    shared = tmp_path_factory.mktemp("slurm-vllm")
    with VCluster(2, shared=[shared, vllm_tiny.parent]) as vc:
        debian_hosts(vc, 0)
        route_out_elsewhere(vc)
        yield MachinesSlurm(vc, shared / "slurm").start(), shared


def test_grpo_on_slurm_with_the_rollout_alone_on_node_1_trains_as_one_machine(slurm, vllm_tiny, one_machine):
    cluster, shared = slurm
    work = shared / "grpo"
    work.mkdir()
    out = work / "out"
    (work / "job.yaml").write_text(config(vllm_tiny, "[0]", "[1]", f"num_machines: 2\nlog_dir: {work / 'logs'}\n"))
    script = work / "job.sh"
    script.write_text(f"#!/bin/bash\ncd {work}\nexec {sys.executable} -m dualrun launch --backend slurm --config_file "
                      "job.yaml " + " ".join(shlex.quote(a) for a in probe(vllm_tiny, out)) + "\n")
    env = {**{k: v for k, v in cluster.env.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}, **ENV}
    code, log = cluster.sbatch(script, "--nodes=2", "--ntasks-per-node=2", env=env, cwd=work, timeout=800)
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
