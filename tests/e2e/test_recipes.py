"""The multi-node recipes that fit on one machine, run exactly as their READMEs write them.

Each recipe README (examples/multi-node/*/README.md) has a "Try it on one machine" bash block; these tests read
that block, change only the literal ports, paths and the Ray temp dir to this test's own (free ports, tmp dirs),
and run the commands. Everything is bound to 127.0.0.1 (the tests run inside a loopback-only namespace).
Ray clusters started here are stopped by killing only the processes of their own `--temp-dir` — never `ray stop`.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from doc_recipes import (doc_blocks, doc_commands, doc_files, one_machine_block, run_block, shell_env,
                         stop_cluster, substitute, token_mode)
from helpers import REPO, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


# -- helpers (the shared ones: tests/support/doc_recipes.py) --------------------------------------------------

PROBE_NODES = """
import collections, sys, ray
ray.init(address=sys.argv[1], log_to_driver=False)
actors = [a for a in ray._private.state.actors().values() if a["ActorClassName"] == "RankWorker"]
print(*collections.Counter(a["Address"]["NodeID"] for a in actors).values())
"""


@pytest.fixture
def ray_temp():
    """A short, unique Ray temp dir (Ray's unix socket paths must stay short); its cluster is stopped after."""
    path = tempfile.mkdtemp(prefix="drr", dir="/tmp")
    yield path
    try:
        stop_cluster(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _trained(out: Path, steps: int) -> None:
    import json

    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == steps, state
    assert [h["step"] for h in state["log_history"] if "loss" in h] == list(range(1, steps + 1))


# -- the recipes -----------------------------------------------------------------------------------------------------

@pytest.mark.ray
@pytest.mark.timeout(240)
def test_ray_by_hand_two_local_nodes(tiny, ray_temp, tmp_path):
    """examples/multi-node/ray-by-hand: `ray start --head`, `ray start --address`, one `dualrun launch --backend
    ray` with 4 CPU workers, which land 2 + 2 on the two nodes."""
    port, out = free_port(), tmp_path / "out"
    cmds = substitute(one_machine_block("ray-by-hand"), {
        "6379": str(port), "/tmp/ray-demo": ray_temp, "/tmp/tiny": str(tiny), "/tmp/out-ray-by-hand": str(out)})
    assert any(c.startswith("ray start --head") for c in cmds) and any("dualrun launch --backend ray" in c
                                                                       for c in cmds)
    proc = run_block(cmds, timeout=220)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    _trained(out, 2)
    assert "cluster=ray (2 node(s))" in proc.stderr, proc.stderr[-3000:]
    # where the 4 ranks ran: the cluster's actor table keeps the (now dead) worker actors with their node
    probe = subprocess.run([sys.executable, "-c", PROBE_NODES, f"127.0.0.1:{port}"], env=shell_env(**token_mode()),
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr[-3000:]
    ranks_per_node = sorted(int(n) for n in probe.stdout.split())
    assert ranks_per_node == [2, 2], (probe.stdout, proc.stderr[-3000:])
    assert "job succeeded" in proc.stderr


@pytest.mark.timeout(200)
def test_torchrun_by_hand_two_local_nodes(tiny, tmp_path):
    """examples/multi-node/torchrun-by-hand: the same `dualrun launch --backend torchrun` twice, machine_rank 0
    and 1 (tests/e2e/test_torchrun_e2e.py::test_two_nodes_on_one_machine checks the env of such ranks)."""
    port, out = free_port(), tmp_path / "out"
    cmds = substitute(one_machine_block("torchrun-by-hand"), {
        "29500": str(port), "/tmp/tiny": str(tiny), "/tmp/out-torchrun-by-hand": str(out)})
    assert subprocess.run(["bash", "-ec", cmds[0]], cwd=REPO, env=shell_env(), capture_output=True,
                          timeout=120).returncode == 0
    nodes = cmds[1:]
    assert [("--machine_rank 0" in c, "--machine_rank 1" in c) for c in nodes] == [(True, False), (False, True)]
    procs = [subprocess.Popen(["bash", "-ec", c], cwd=REPO, env=shell_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for c in nodes]
    try:
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], [o[1][-3000:] for o in outs]
    _trained(out, 2)


@pytest.mark.ray
@pytest.mark.timeout(240)
def test_ray_jobs_against_local_cluster(tiny, ray_temp, tmp_path):
    """examples/multi-node/ray-jobs: a head with its dashboard on 127.0.0.1, then `ray job submit --working-dir .
    -- dualrun launch --backend ray ...`; the submit waits for the job and returns its status."""
    port, dash, out = free_port(), free_port(), tmp_path / "out"
    cmds = substitute(one_machine_block("ray-jobs"), {
        "6379": str(port), "8265": str(dash), "/tmp/ray-demo": ray_temp, "/tmp/tiny": str(tiny),
        "/tmp/out-ray-jobs": str(out)})
    assert any(c.startswith("ray job submit") and "--working-dir ." in c for c in cmds)
    proc = run_block(cmds, timeout=220)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    logs = proc.stdout + proc.stderr
    assert "[train rank 0]" in logs and "[train rank 1]" in logs, logs[-3000:]
    assert re.search(r"Job 'raysubmit_\w+' succeeded", logs), logs[-3000:]
    _trained(out, 2)


# -- docs/plugins.md: the third-party plugin, exactly as written ----------------------------------------------------


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["torchrun", "ray"])
def test_plugin_example_from_docs(backend, tmp_path):
    """docs/plugins.md's `judge` plugin, registered under the `dualrun.plugins` entry-point group (a dist-info on
    PYTHONPATH is what `pip install` leaves), runs its server on its own process and wires the unchanged script."""
    doc = REPO / "docs" / "plugins.md"
    files = doc_files(doc)
    assert {"dualrun_judge/__init__.py", "dualrun_judge/config.py", "dualrun_judge/server.py",
            "dualrun_judge/plugin.py"} <= set(files), sorted(files)
    site = tmp_path / "site"
    for name, text in files.items():
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_text(text)
    toml = next(b for b in doc_blocks(doc, "toml") if "dualrun.plugins" in b)
    entry = re.search(r'^(\w+) = "([\w.:]+)"', toml.split('[project.entry-points."dualrun.plugins"]')[1], re.M)
    dist = site / "dualrun_judge-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: dualrun-judge\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text(f"[dualrun.plugins]\n{entry.group(1)} = {entry.group(2)}\n")
    job = tmp_path / "job"
    (job / "out").mkdir(parents=True)
    (job / "judge_cpu.yaml").write_text(next(b for b in doc_blocks(doc, "yaml") if "method: judge" in b))
    (job / "score.py").write_text(next(b for b in doc_blocks(doc, "python") if "JudgeConfig()" in b))
    launch = next(c for c in doc_blocks(doc, "bash")[0].splitlines() if f"--backend {backend}" in c)
    env = shell_env(PYTHONPATH=str(site), RAY_TMPDIR=tempfile.mkdtemp(prefix="drp", dir="/tmp"))
    try:
        proc = subprocess.run(["bash", "-ec", launch], cwd=job, env=env, capture_output=True, text=True,
                              timeout=220)
    finally:
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "JudgeConfig: {'judge_url': 'http://" in proc.stderr, proc.stderr[-3000:]
    import json

    ranks = [json.loads((job / "out" / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert r["judge_url"].startswith("http://127.0.0.1:"), r
        assert r["answer"] == {"model": "words-v1", "score": 9}, r


# -- examples/api_example.py: the Python API ------------------------------------------------------------------------

@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["torchrun", "ray"])
def test_api_example(backend, tiny, tmp_path, ray_cluster_if_ray):
    """`dualrun.launch(fn)` returns every rank's value; `dualrun.launch(script)` runs examples/sft.py; 2 CPU workers
    (Ray: on the run's running cluster, as `RAY_ADDRESS` gives it)."""
    import json

    cluster = ray_cluster_if_ray
    env = shell_env(RAY_TMPDIR=tempfile.mkdtemp(prefix="dra", dir="/tmp"),
                    **({"RAY_ADDRESS": cluster.address} if cluster else {}))
    try:
        proc = subprocess.run([sys.executable, str(REPO / "examples" / "api_example.py"), "--backend", backend,
                               "--tiny", str(tiny), "--out", str(tmp_path / "sft")], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=280)
    finally:
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.split("SUMMARY ", 1)[1])
    fn = summary["function"]
    assert [r["rank"] for r in fn] == [0, 1] and {r["world_size"] for r in fn} == {2}
    assert {r["backend"] for r in fn} == {backend}
    assert fn[0]["weights"] == fn[1]["weights"] and fn[0]["loss"] < 1.0, fn
    assert summary["script"]["exit_codes"] == [0, 0] and len(summary["script"]["losses"]) == 2, summary
    if cluster:
        cluster.assert_nothing_left()


# -- docs/migration.md: every dualrun command line is valid as written ---------------------------------------------


@pytest.mark.ray
@pytest.mark.timeout(240)
def test_migration_commands(tiny, tmp_path):
    """Each `dualrun launch` line of docs/migration.md, with --dry_run: config valid, script found, plan made.
    (They were also run for real on CPU when written; --dry_run keeps this test to seconds.)"""
    doc = REPO / "docs" / "migration.md"
    acc = next(b for b in doc_blocks(doc, "yaml") if b.startswith("compute_environment"))
    (tmp_path / "accelerate_cpu.yaml").write_text(acc)
    commands = doc_commands(doc)
    assert len(commands) >= 5, commands
    assert any("--backend ray" in c for c in commands) and any("sampling" in c for c in commands)
    for cmd in commands:
        cmd = cmd.replace("/tmp/accelerate_cpu.yaml", str(tmp_path / "accelerate_cpu.yaml"))
        cmd = cmd.replace("/tmp/tiny", str(tiny)).replace("/tmp/mig-", str(tmp_path / "mig-"))
        if "--dry_run" not in cmd:
            cmd = cmd.replace("dualrun launch", "dualrun launch --dry_run", 1)
        proc = subprocess.run(["bash", "-ec", cmd], cwd=REPO, env=shell_env(RAY_TMPDIR=str(tmp_path)),
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, (cmd, proc.stderr[-2000:])
        assert "nothing was started" in proc.stdout or "dry run" in proc.stdout.lower(), (cmd, proc.stdout[-2000:])
