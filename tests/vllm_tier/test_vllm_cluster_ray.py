"""GRPO with a real vLLM rollout (the CPU build) across three Ray nodes of the virtual cluster
(tests/support/vcluster.py): the head on machine 0 (`--num-cpus 0`, the driver only) and two worker nodes of 3 CPUs,
started by the lines of examples/multi-node/ray-by-hand/README.md from this venv (tests/support/cluster_ray.py). Each
machine's default route goes out through an interface of its own that no other machine reaches (`route_out_elsewhere`),
as on nodes with a management or public network beside the cluster's: "this host's address on its route out", which
vLLM's `get_ip()` gives trainer rank 0 to advertise to the engines, is then wrong, and only the node's Ray address is
right.

`dualrun check` forms the weight-sync group at trainer rank 0's Ray address. Then one `dualrun launch --backend ray`
on the head runs the vLLM tier's probe job (tests/support/vllm_helpers.py `grpo_job`, assets/grpo_server_probe.py: TRL's
unchanged GRPOTrainer, and AsyncGRPOTrainer's weight transfer) with `ray.num_cpus_per_worker: 2`: the rollout server
and the trainer each hold 2 of a node's 3 CPUs, so they run on the two worker nodes, one each, whichever Ray places
first, and every weight sync crosses the link over gloo. Asserted: where each actor ran (Ray's actor table), the
master address the engine joined, every sync landed (the engine serves the trainer's weights at every step), the
same training bit for bit as the same job on torchrun on one machine (conftest.grpo_one_machine, the run
test_vllm_rollout.py starts from), exit 0, and nothing of the job left: no actor or placement group on the cluster,
no process naming or working in the job's directory and no vLLM engine on any machine."""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

import cluster_ray
from cluster_jobs import route_out_elsewhere
from cluster_ray import WORKERS, nothing_left, on_head, table
from helpers import pids_matching
from vllm_helpers import (TIER, assert_async_syncs_landed, assert_every_sync_landed, assert_same_training, grpo_job,
                          grpo_probe_argv, rollout_address)

pytestmark = [*TIER, pytest.mark.cluster, pytest.mark.ray, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm-ray3")


@pytest.fixture(scope="module")
def ray3(shared, vllm_tiny):
    with cluster_ray.ray3(shared, vllm_tiny, prepare=route_out_elsewhere) as vc:
        yield vc


def job(tiny: Path) -> str:
    """The vLLM tier's probe job (the reference's, with vLLM's own processes), each actor holding 2 CPUs."""
    return grpo_job(tiny, processes=True, extra="ray: {num_cpus_per_worker: 2}\n")


def test_check_forms_the_weight_sync_group_at_the_trainer_nodes_ray_address(ray3, shared, vllm_tiny):
    """`dualrun check` on the head, before any model loads: trainer rank 0's node advertises its Ray address (not
    its route-out address on wan0), and the group forms across the two worker nodes."""
    work = shared / "check"
    work.mkdir()
    (work / "ray.yaml").write_text(job(vllm_tiny))
    proc = on_head(ray3, [sys.executable, "-m", "dualrun", "check", "--backend", "ray", "--config_file", "ray.yaml"],
                   work, 300)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    group = [line for line in lines if line.startswith("dualrun check: weight sync: gloo group")]
    formed = len(group) == 1 and re.fullmatch(
        r"dualrun check: weight sync: gloo group of 2 at ([\d.]+):\d+ \(trainer rank 0 on node \d ([\d.]+); rollout "
        r"server 0 \(rank 1\) on node \d ([\d.]+)\) moved a tensor in [\d.]+ s", group[0])
    assert formed and formed.group(1) == formed.group(2) and {formed.group(2), formed.group(3)} == WORKERS, lines


def test_grpo_with_its_vllm_rollout_on_another_node_gives_the_training_of_one_machine(grpo_one_machine, ray3,
                                                                                     shared, vllm_tiny):
    work = shared / "grpo"
    (work / "out").mkdir(parents=True)
    out = cluster_ray.launch(ray3, work, job(vllm_tiny), grpo_probe_argv(vllm_tiny), timeout=600)
    actors = table(ray3, shared)["actors"]
    [rank] = [a["ip"] for a in actors if a["cls"] == "RankWorker"]
    [server] = [a["ip"] for a in actors if a["cls"] == "ServerActor"]
    assert {rank, server} == WORKERS, actors   # the trainer and the engine on the two worker nodes, one each
    placed = re.search(r"train: 1 worker\(s\) placed on 1 node\(s\), master (\S+):\d+, GLOO_SOCKET_IFNAME=eth0", out)
    assert placed and placed.group(1) == rank, out[-3000:]
    address = rollout_address(out)
    assert address.rpartition(":")[0] == server, out[-3000:]
    joined = re.search(r"dualrun gloo weight transfer: rank 1 of 2 \(trainer at ([\d.]+):(\d+)\)",
                       (work / "logs" / "rollout-server-0.log").read_text())
    assert joined and joined.group(1) == rank, (work / "logs" / "rollout-server-0.log").read_text()[-3000:]
    rec = json.loads((work / "out" / "rank0.json").read_text())
    grpo = rec["grpo"]
    assert (grpo["vllm_server_host"], str(grpo["vllm_server_port"])) == tuple(address.split(":"))
    assert rec["async_url"] == f"http://{address}"
    assert_every_sync_landed(rec, replicas=1)
    assert_async_syncs_landed(rec, replicas=1)
    assert_same_training(rec, grpo_one_machine.rec, "across Ray nodes vs torchrun on one machine")
    nothing_left(ray3, shared)
    assert not pids_matching(str(work)), pids_matching(str(work))
    assert not engines_on(ray3), engines_on(ray3)
    assert not working_in(work), working_in(work)


def engines_on(vc) -> dict[int, str]:
    """vLLM's engine processes (they rename themselves `VLLM::...`) on any machine of the cluster, by PID namespace
    (other vLLM jobs on this host are not the cluster's), and their working directories."""
    machines = {os.readlink(f"/proc/{vc.pid(k)}/ns/pid") for k in range(vc.size)}
    found = {}
    for pid in pids_matching("VLLM::"):
        try:
            if os.readlink(f"/proc/{pid}/ns/pid") in machines:
                found[pid] = os.path.realpath(f"/proc/{pid}/cwd")
        except OSError:
            continue
    return found


def working_in(work: Path) -> dict[int, str]:
    """Processes on any machine (their PID namespaces are within this one) working in `work`, and their commands:
    the job's trainer, its engine and their helpers run there."""
    found, where = {}, Path(os.path.realpath(work))
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and Path(os.path.realpath(entry / "cwd")).is_relative_to(where):
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
        except OSError:
            continue
    return found
