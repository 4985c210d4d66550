"""Ray across three machines of the virtual cluster (tests/support/vcluster.py), for the modules that run jobs there
(tests/cluster/test_cluster_ray.py, tests/cluster/test_cluster_ray_faults.py, tests/vllm_tier/test_vllm_cluster_ray.py):
a head on machine 0 started with `--num-cpus 0` and a worker node on machines 1 and 2 (3 CPUs each), each by its own
`ray start` there, as the lines of examples/multi-node/ray-by-hand/README.md ("Try it on a virtual cluster") write it;
the cluster's actor table read from a driver on the head; `dualrun launch` on the head. And, for the fleet tests
(tests/cluster/test_cluster_ray_fleet.py, tests/cluster/test_cluster_vllm_ray_fleet.py), a head of a given size and a
node that joins mid-run and leaves (`start_head`, `join`, `leave`).

Why one place: each module starts its own cluster (a lost node spoils the next job; the vLLM tier runs in another
venv), and each reads the same table to say where every actor ran and that none is left. The `ray` and `python` the
README's lines run are those of the interpreter running the tests (tests/support/doc_recipes.py's `shell_env`), so the
vLLM tier's cluster runs .venv-vllm's Ray and dualrun."""
from __future__ import annotations

import json
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from cluster_jobs import ENV
from helpers import eventually
from doc_recipes import one_machine_block, run_block, shell_env, token_mode
from vcluster import VCluster, address

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
    assert lines[1].startswith("python tests/support/vcluster.py --machines 3 --share /tmp/tiny -- bash")
    rest = next(i for i, line in enumerate(lines) if line.startswith("printf"))
    return lines[2:rest], lines[rest:]


def pids(vc: VCluster) -> dict[str, str]:
    """The cluster's pids as the README's `vcluster.py` command gives them to its shell."""
    return {"VCLUSTER_PIDS": ",".join(str(vc.pid(k)) for k in range(vc.size)), "VCLUSTER_SWITCH": str(vc.switch[1])}


def start_ray(vc: VCluster, cwd: Path) -> None:
    """The README's lines that start the head and the two worker nodes, run in a shell beside the cluster; returns
    once all three nodes are alive."""
    start, _ = readme()
    assert [line.split(" -- ")[-1].split()[:3] for line in start if " on " in line] == [
        ["ray", "start", "--head"], ["ray", "start", "--address"]], start
    proc = run_block(start, timeout=240, env=pids(vc))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert eventually(lambda: len(table(vc, cwd)["nodes"]) == 3, timeout=60), table(vc, cwd)


@contextmanager
def ray3(shared: Path, tiny: Path, prepare=None) -> Iterator[VCluster]:
    """Three machines sharing `shared` and the tiny assets, Ray started on them (`start_ray`); `prepare(vc)` runs on
    the machines before Ray starts (a hosts file, say). Leaving it ends every process of the three machines."""
    with VCluster(3, shared=[shared, tiny.parent]) as vc:
        if prepare is not None:
            prepare(vc)
        start_ray(vc, shared)
        yield vc


def nothing_left(vc: VCluster, cwd: Path) -> None:
    """No live actor and no placement group of any job left on the cluster."""
    assert eventually(lambda: not [a for a in table(vc, cwd)["actors"] if a["state"] != "DEAD"]
                      and not table(vc, cwd)["groups"], timeout=30), table(vc, cwd)


def launch(vc: VCluster, work: Path, config: str, argv: list[str], timeout: float = 400, **env: str) -> str:
    """`dualrun launch --backend ray` on the head in `work`; its output (stdout and stderr); exit 0 asserted."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "ray.yaml").write_text(config)
    proc = on_head(vc, [sys.executable, "-m", "dualrun", "launch", "--backend", "ray", "--config_file", "ray.yaml",
                        *argv], work, timeout, **env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    return out


# -- a cluster whose nodes come and go (tests/cluster/test_cluster_ray_fleet.py, test_cluster_vllm_ray_fleet.py) ----
def start_head(vc: VCluster, cpus: int, cwd: Path) -> None:
    """`ray start --head` on machine 0 with `cpus` logical CPUs: exactly what the plan's actors there hold, so that a
    fleet's spare finds room only on a node that joins."""
    proc = vc.run(0, ["ray", "start", "--head", "--node-ip-address", HEAD, "--port", "6379", "--num-cpus", str(cpus),
                      "--include-dashboard=false", "--disable-usage-stats"], cwd=cwd, timeout=240,
                  env=shell_env(**token_mode()))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def join(vc: VCluster, machine: int, cpus: int, cwd: Path) -> subprocess.Popen:
    """`ray start --address HEAD --block` on `machine` (a node joining mid-run), returned once the cluster counts
    it. The Popen is the test's own: its raylet and the rest of the node's Ray processes end with it (`leave`)."""
    before = len(table(vc, cwd)["nodes"])
    log = open(cwd / f"ray-start-{machine}.out", "w")
    node = vc.popen(machine, ["ray", "start", "--address", RAY, "--num-cpus", str(cpus), "--disable-usage-stats",
                              "--block"], cwd=cwd, env=shell_env(**token_mode()), stdout=log,
                    stderr=subprocess.STDOUT)
    log.close()
    assert eventually(lambda: node.poll() is not None or len(table(vc, cwd)["nodes"]) > before, timeout=180), \
        (cwd / f"ray-start-{machine}.out").read_text()[-3000:]
    assert node.poll() is None, (cwd / f"ray-start-{machine}.out").read_text()[-3000:]
    return node


def leave(vc: VCluster, machine: int, node: subprocess.Popen, cwd: Path) -> None:
    """The node on `machine` removed: its raylet stopped by its pid there (SIGTERM, as a drained or reclaimed machine's
    is; never `ray stop`, which would stop every node this host runs). Once the cluster counts it gone, `ray start
    --block` (which takes a raylet's SIGTERM as a graceful end and keeps blocking) is ended too, with what it
    started."""
    found = vc.run(machine, ["pgrep", "-x", "raylet"], timeout=30).stdout.split()
    assert len(found) == 1, found
    vc.run(machine, ["kill", "-TERM", found[0]], timeout=30, check=True)
    assert eventually(lambda: address(machine) not in table(vc, cwd)["nodes"], timeout=120), table(vc, cwd)
    node.terminate()
    node.wait(timeout=60)


def processes(vc: VCluster, machine: int) -> list[str]:
    """Every process on `machine` but its first (the namespace's holder) and the `ps` that lists them."""
    rows = vc.run(machine, ["ps", "-eo", "pid,args"], timeout=30, check=True).stdout.strip().splitlines()[1:]
    return [r for r in rows if r.split(None, 1)[0] != "1" and "ps -eo" not in r]
