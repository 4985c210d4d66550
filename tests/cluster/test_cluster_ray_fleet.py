"""A fleet on Ray follows the cluster across machines of the virtual cluster (tests/support/vcluster.py): a Ray head on
machine 0 with just the CPUs of the plan's actors started at launch (the trainer rank, the teacher's router, its
first replica), `dualrun launch --backend ray` there; mid-run a node joins with `ray start --address HEAD` on
machine 1 (one CPU: room for one replica), later its raylet is stopped by its pid (never `ray stop`).

- GKD with a teacher fleet (CPU engines, min 1, max 2) grows onto the node that joins (dualrun's line naming its
  address), serves with both replicas, loses the one whose node left (`1 of min 1 remain`) and ends 0 with the
  losses of the same job on a fixed fleet (the same config before the node joined: no room to grow), bit for bit.
- Below `min_replicas`: the teacher's only replica on machine 1's node (the head's CPUs held by a placement group of
  the test's own while it is placed), that node removed mid-run: the job ends naming the replica and the node.
Each leaves nothing: no actor or placement group on the cluster, no process on machine 1, none in the job's folder.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cluster_jobs import ENV, gkd_args
from cluster_ray import RAY, join, leave, nothing_left, processes, start_head, table
from doc_recipes import shell_env, token_mode
from helpers import eventually, pids_matching
from vcluster import VCluster, address

pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(900)]

STEPS = 6


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ray-fleet")


@pytest.fixture(scope="module")
def vc(shared, tiny):
    """Machine 0: the head, 3 CPUs (the rank, the router, one replica). Machine 1: no Ray until a test joins it."""
    with VCluster(2, shared=[shared, tiny.parent]) as cluster:
        start_head(cluster, 3, shared)
        yield cluster


def config(tiny: Path, work: Path) -> str:
    return ("use_cpu: true\nmethod: gkd\nroles:\n  train: {gpus: 1}\n"
            f"  teacher: {{gpus: 1, min_replicas: 1, max_replicas: 2, model: {tiny / 'teacher'}, top_k: 5, "
            f"health_timeout_s: 300, server_args: [--verbose]}}\nlog_dir: {work / 'logs'}\n")


def start(vc: VCluster, work: Path, tiny: Path, *more: str) -> subprocess.Popen:
    """`dualrun launch --backend ray` of the GKD probe on the head, in `work` (its output in work/launch.out)."""
    (work / "out").mkdir(parents=True)
    (work / "ray.yaml").write_text(config(tiny, work))
    argv = [*gkd_args(tiny, work / "out"), "--max_steps", str(STEPS), *more]
    with open(work / "launch.out", "w") as out:
        return vc.popen(0, [sys.executable, "-m", "dualrun", "launch", "--backend", "ray", "--config_file", "ray.yaml",
                            *argv], cwd=work, stdout=out, stderr=subprocess.STDOUT,
                        env=shell_env(RAY_ADDRESS=RAY, **ENV, **token_mode()))


def until(launch: subprocess.Popen, work: Path, what, timeout: float = 300):
    """`what()` once truthy while the launch runs; fails with its output when it ended or the time ran out."""
    out = lambda: (work / "launch.out").read_text()  # noqa: E731
    found = eventually(lambda: what() or launch.poll() is not None, timeout=timeout, every=0.5)
    assert found and launch.poll() is None, out()[-5000:]
    return what()


def line(work: Path, pattern: str):
    return re.search(pattern, (work / "launch.out").read_text())


def ended(launch: subprocess.Popen, timeout: float) -> int:
    try:
        return launch.wait(timeout=timeout)
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.wait()


def test_a_teacher_fleet_grows_onto_a_node_that_joins_and_loses_it_with_the_fixed_fleets_losses(vc, shared, tiny):
    fixed = shared / "fixed"   # the same job before any node joined: the head has no room for a second replica
    assert ended(start(vc, fixed, tiny), 400) == 0, (fixed / "launch.out").read_text()[-5000:]
    reference = json.loads((fixed / "out" / "rank0.json").read_text())["losses"]
    assert len(reference) == STEPS and "joined at" not in (fixed / "launch.out").read_text()
    nothing_left(vc, shared)

    work = shared / "grown"
    gate = work / "gate"
    work.mkdir()
    for step in (2, 4):
        Path(f"{gate}.{step}").touch()
    launch = start(vc, work, tiny, "--hold_file", str(gate), "--hold_steps", "2,4")
    node = None
    try:
        until(launch, work, lambda: Path(f"{gate}.2.held0").exists())
        node = join(vc, 1, 1, shared)
        room = until(launch, work, lambda: line(work, r"dualrun: teacher: the cluster has room for another replica on "
                                                      rf"node {re.escape(address(1))} \((\w{{8}})\); starting one "
                                                      r"there \(1 run, target 2\)"))
        until(launch, work, lambda: line(work, rf"dualrun: teacher server 1 joined at {re.escape(address(1))}:\d+, "
                                               r"serving"))
        servers = {a["name"]: a["ip"] for a in table(vc, shared)["actors"]
                   if a["cls"] == "ServerActor" and a["state"] == "ALIVE"}
        assert sorted(servers.values()) == sorted([address(0), address(0), address(1)]), servers   # + the router
        Path(f"{gate}.2").unlink()   # steps 3 and 4 on both replicas
        until(launch, work, lambda: Path(f"{gate}.4.held0").exists())
        leave(vc, 1, node, shared)
        until(launch, work, lambda: line(work, rf"dualrun: teacher server 1 left \(died: teacher server 1: its node "
                                               rf"{re.escape(address(1))} \({room.group(1)}\) left the cluster .*\); "
                                               r"1 of min 1 remain"))
        Path(f"{gate}.4").unlink()   # steps 5 and 6 on the one left
        code = ended(launch, 400)
    finally:
        if launch.poll() is None:
            launch.kill()
        if node is not None and node.poll() is None:
            node.kill()
    out = (work / "launch.out").read_text()
    assert code == 0, out[-5000:]
    served = (work / "logs" / "teacher-server-1.log").read_text().count('"POST /v1/completions')
    assert served >= 1, "the replica that joined served no request"
    assert json.loads((work / "out" / "rank0.json").read_text())["losses"] == reference   # bit for bit
    assert "restarting" not in out, out[-5000:]
    nothing_left(vc, shared)
    assert sorted(table(vc, shared)["nodes"]) == [address(0)]
    assert eventually(lambda: not processes(vc, 1), timeout=60), processes(vc, 1)
    assert not pids_matching(str(work))


# The test's own placement group holding every CPU of the head until the teacher's first replica is placed (on the
# node of machine 1, the only room then), then one CPU of it for the rest of the job: the router and the rank take
# the others, and the fleet's pending group finds no room to grow back onto the head.
HOLD = """
import sys, time, ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
ray.init(address=sys.argv[1], log_to_driver=False)
head = placement_group([{"CPU": 3.0}], name="test-holds-the-head")
ray.get(head.ready(), timeout=120)
print("held", flush=True)
while not any("teacher-server-0" in (g.get("name") or "") and g.get("state") == "CREATED"
              for g in placement_group_table().values()):
    time.sleep(0.2)
one = placement_group([{"CPU": 1.0}], name="test-holds-one")   # pending until the head's three are given back
remove_placement_group(head)
ray.get(one.ready(), timeout=120)
print("one", flush=True)
sys.stdin.read()   # until the test closes it: the group goes with this driver
"""


def test_a_fleet_below_min_replicas_ends_naming_the_replica_and_its_node(vc, shared, tiny):
    work = shared / "below"
    work.mkdir()
    node = join(vc, 1, 1, shared)
    hold = vc.popen(0, [sys.executable, "-c", HOLD, RAY], cwd=shared, env=shell_env(**token_mode()),
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    launch = None
    try:
        assert hold.stdout.readline() == "held\n"
        gate = work / "gate"
        Path(f"{gate}.1").touch()
        launch = start(vc, work, tiny, "--hold_file", str(gate), "--hold_steps", "1")
        assert hold.stdout.readline() == "one\n"
        until(launch, work, lambda: Path(f"{gate}.1.held0").exists())
        where = {a["name"]: a["ip"] for a in table(vc, shared)["actors"] if a["state"] == "ALIVE"}
        assert [ip for name, ip in where.items() if "teacher-server-0" in name] == [address(1)], where
        leave(vc, 1, node, shared)
        code = ended(launch, 300)
    finally:
        if launch is not None and launch.poll() is None:
            launch.kill()
        if node.poll() is None:
            node.kill()
        hold.stdin.close()
        hold.wait(timeout=60)
    out = (work / "launch.out").read_text()
    assert code == 1, out[-5000:]
    assert re.search(rf"teacher server 0: its node {re.escape(address(1))} \(\w{{8}}\) left the cluster", out), \
        out[-5000:]
    assert "1 of min 1 remain" not in out and "teacher server 1 joined" not in out, out[-5000:]
    nothing_left(vc, shared)
    assert eventually(lambda: not processes(vc, 1), timeout=60), processes(vc, 1)
    assert not pids_matching(str(work))
