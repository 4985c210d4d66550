"""The Ray backend on real Ray (loopback only, fake GPUs): env parity with torchrun, two nodes, failures, cleanup."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import cmdline, dualrun, eventually, pids_matching
from ray_helpers import (CRASH, DUMP_ENV, FAIL_FIRST_ATTEMPT, GLOO, KILL_ACTOR, SLEEP, FakeGpuCluster, ray_env)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

CPU2 = "use_cpu: true\nroles: {train: {gpus: 2}}\nenv: {FROM_CONFIG: yes}\n"
# values a backend defines itself; every other value, and every name, must be the same on both backends
BACKEND_DEFINED = {"LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT", "DUALRUN_RUN_ID", "TORCHELASTIC_RUN_ID",
                   "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE", "DUALRUN_BACKEND",
                   "DUALRUN_JOB_TOKEN"}   # (the last: a fresh secret per launch, whatever the backend)


@pytest.fixture(scope="module")
def cluster():
    c = FakeGpuCluster(nodes=2, gpus=2, cpus=2)
    yield c
    c.shutdown()


@pytest.fixture
def job(tmp_path):
    (tmp_path / "out").mkdir()
    for name, text in {"dump.py": DUMP_ENV, "gloo.py": GLOO, "crash.py": CRASH, "sleep.py": SLEEP,
                       "kill_actor.py": KILL_ACTOR, "flaky.py": FAIL_FIRST_ATTEMPT, "cpu2.yaml": CPU2}.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def _envs(out: Path) -> list[dict[str, str]]:
    files = sorted(out.glob("env_*.json"), key=lambda p: int(p.stem.split("_")[1]))
    return [json.loads(p.read_text()) for p in files]


def _assert_clean(cluster: FakeGpuCluster, marker: str) -> None:
    assert eventually(lambda: not cluster.alive_actors()), cluster.alive_actors()
    assert eventually(lambda: not cluster.live_placement_groups()), cluster.live_placement_groups()
    assert eventually(lambda: not pids_matching(marker)), pids_matching(marker)


@pytest.mark.ray
@pytest.mark.slow
def test_env_names_equal_torchrun(job, cluster):
    """Same config file, only --backend differs: same variable names, same values except backend-defined ones."""
    (job / "tr").mkdir()
    (job / "ry").mkdir()
    env = ray_env(RAY_ADDRESS=cluster.address)
    t = dualrun("launch", "--backend", "torchrun", "--config_file", "cpu2.yaml", "dump.py", "tr", cwd=job, env=env)
    assert t.returncode == 0, t.stderr
    r = dualrun("launch", "--backend", "ray", "--config_file", "cpu2.yaml", "dump.py", "ry", cwd=job, env=env)
    assert r.returncode == 0, r.stderr
    tr, ry = _envs(job / "tr"), _envs(job / "ry")
    assert len(tr) == len(ry) == 2
    for a, b in zip(tr, ry):
        assert sorted(a) == sorted(b)
        differ = {k for k in a if a[k] != b[k]}
        assert differ <= BACKEND_DEFINED, {k: (a[k], b[k]) for k in differ - BACKEND_DEFINED}
    assert [e["LOCAL_RANK"] for e in ry] == ["0", "0"] and ry[0]["LOCAL_WORLD_SIZE"] == "1"
    assert ry[0]["DUALRUN_BACKEND"] == "ray" and ry[0]["TORCHELASTIC_USE_AGENT_STORE"] == "False"
    assert not any(k.startswith("RAY_") for k in ry[0])


@pytest.mark.ray
@pytest.mark.slow
def test_two_nodes_one_gpu_each(job, cluster):
    """4 GPU ranks on 2 nodes x 2 fake GPUs: both nodes used, distinct GPU per node, LOCAL_RANK=0, one master
    (on the port `--main_process_port` asks for, as torchrun would)."""
    from dualrun.light.ports import free_port

    port = free_port("127.0.0.1")
    (job / "gpu4.yaml").write_text(f"roles: {{train: {{gpus: 4}}}}\nray: {{address: '{cluster.address}'}}\n")
    proc = dualrun("launch", "--backend", "ray", "--config_file", "gpu4.yaml", "--main_process_port", str(port),
                   "dump.py", "out", cwd=job, env=ray_env())
    assert proc.returncode == 0, proc.stderr
    envs = _envs(job / "out")
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert {e["NODE_RANK"] for e in envs} == {"0", "1"} and {e["GROUP_WORLD_SIZE"] for e in envs} == {"2"}
    assert all(e["NODE_RANK"] == e["GROUP_RANK"] for e in envs)
    slots = {(e["NODE_RANK"], e["CUDA_VISIBLE_DEVICES"]) for e in envs}
    assert len(slots) == 4 and all(len(gpu.split(",")) == 1 and gpu in ("0", "1") for _, gpu in slots)
    assert {e["LOCAL_RANK"] for e in envs} == {"0"} and {e["WORLD_SIZE"] for e in envs} == {"4"}
    assert {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"} and {e["MASTER_PORT"] for e in envs} == {str(port)}
    assert envs[0]["NODE_RANK"] == "0" and envs[0]["ACCELERATE_USE_CPU"] == "False"
    _assert_clean(cluster, str(job))


@pytest.mark.ray
@pytest.mark.slow
def test_crash_on_rank_1_stops_everything(job, cluster):
    proc = dualrun("launch", "--backend", "ray", "--config_file", "cpu2.yaml", "crash.py", str(job), cwd=job,
                   env=ray_env(RAY_ADDRESS=cluster.address), timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "train rank 1 failed (exit code 1): ValueError: rank one is broken" in proc.stderr
    assert "[train rank 1] ValueError: rank one is broken" in proc.stderr
    assert "[train rank 0] started 0" in proc.stdout
    _assert_clean(cluster, str(job))


@pytest.mark.ray
@pytest.mark.slow
def test_dead_actor_is_a_failure(job, cluster):
    proc = dualrun("launch", "--backend", "ray", "--config_file", "cpu2.yaml", "kill_actor.py", str(job), cwd=job,
                   env=ray_env(RAY_ADDRESS=cluster.address), timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "train rank 1 failed" in proc.stderr and re.search(r"its Ray actor on node [\d.]+ died", proc.stderr)
    _assert_clean(cluster, str(job))


@pytest.mark.ray
@pytest.mark.slow
def test_max_failures_restarts_the_whole_job(job, cluster):
    (job / "retry.yaml").write_text(CPU2 + "max_failures: 1\n")
    proc = dualrun("launch", "--backend", "ray", "--config_file", "retry.yaml", "flaky.py", str(job), cwd=job,
                   env=ray_env(RAY_ADDRESS=cluster.address), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "train rank 1 failed (exit code 7)" in proc.stderr and "restarting the job (1/1)" in proc.stderr
    assert "[train rank 0] attempt 1" in proc.stdout and "[train rank 1] attempt 1" in proc.stdout
    assert "after 1 restart(s)" in proc.stderr
    _assert_clean(cluster, str(job))


@pytest.mark.ray
@pytest.mark.slow
def test_more_gpus_than_the_cluster_has(job, cluster):
    (job / "gpu6.yaml").write_text("roles: {train: {gpus: 6}}\nray: {placement_timeout_s: 60}\n")
    start = time.monotonic()
    proc = dualrun("launch", "--backend", "ray", "--config_file", "gpu6.yaml", "dump.py", "out", cwd=job,
                   env=ray_env(RAY_ADDRESS=cluster.address))
    assert proc.returncode == 2, proc.stderr
    assert time.monotonic() - start < 30
    line = proc.stderr.strip().splitlines()[-1]
    assert "roles.train.gpus" in line and "6" in line and "4" in line, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not cluster.live_placement_groups()


@pytest.mark.ray
@pytest.mark.slow
def test_unplaceable_group_times_out(job, cluster):
    """STRICT_SPREAD of 3 bundles over 2 nodes can never be placed: a clear error after the timeout."""
    (job / "spread.yaml").write_text("roles: {train: {gpus: 3}}\n"
                                     "ray: {placement_strategy: STRICT_SPREAD, placement_timeout_s: 3}\n")
    start = time.monotonic()
    proc = dualrun("launch", "--backend", "ray", "--config_file", "spread.yaml", "dump.py", "out", cwd=job,
                   env=ray_env(RAY_ADDRESS=cluster.address))
    took = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr   # a layout the cluster cannot hold: the user's to fix, like bad input
    assert "could not be placed within ray.placement_timeout_s=3 s" in proc.stderr
    assert "STRICT_SPREAD" in proc.stderr and "Traceback" not in proc.stderr
    assert took < 20
    _assert_clean(cluster, str(job))


def _sleeping_job(job: Path, env: dict, script: str = "sleep.py", **popen) -> subprocess.Popen:
    """`script` (sleep.py) on 2 ranks, returned once both said they are ready."""
    driver = subprocess.Popen([sys.executable, "-m", "dualrun", "launch", "--backend", "ray", "--config_file",
                               "cpu2.yaml", script, str(job)], cwd=job, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, **popen)
    seen = set()
    try:
        while len(seen) < 2:
            line = driver.stdout.readline()
            assert line, driver.stderr.read()
            if line.startswith("[train rank") and "ready" in line:
                seen.add(line.split("]")[0])
    except BaseException:
        driver.kill()   # the driver's own cleanup does not run: its ranks' actors die with its cluster connection
        driver.wait()
        raise
    return driver


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_on_the_driver_stops_the_job(job, cluster, sig, code):
    driver = _sleeping_job(job, dict(os.environ, **ray_env(RAY_ADDRESS=cluster.address)))
    assert len(pids_matching(str(job))) >= 2
    sent = time.monotonic()
    driver.send_signal(sig)
    got = driver.wait(timeout=15)
    assert time.monotonic() - sent < 10
    err = driver.stderr.read()
    assert got == code, err
    assert f"stopped by {sig.name}" in err
    _assert_clean(cluster, str(job))


STUBBORN = """import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", os.environ["RANK"], flush=True)
time.sleep(120)
"""


@pytest.mark.ray
@pytest.mark.slow
def test_a_rank_that_ignores_sigterm_is_killed_after_the_grace_and_the_summary_says_what_took_the_time(job, cluster):
    (job / "stubborn.py").write_text(STUBBORN)
    driver = _sleeping_job(job, dict(os.environ, **ray_env(RAY_ADDRESS=cluster.address)), "stubborn.py")
    driver.send_signal(signal.SIGTERM)
    got = driver.wait(timeout=60)
    err = driver.stderr.read()
    assert got == 143, err
    found = re.search(r"dualrun: stopping took ([\d.]+) s \(the ranks ([\d.]+) s\)", err)
    assert found and float(found[2]) >= 3.0, err[-3000:]   # SIGKILL after the 3 s grace
    _assert_clean(cluster, str(job))


@pytest.mark.ray
@pytest.mark.slow
def test_plan_shows_the_live_cluster(job, cluster):
    (job / "gpu4.yaml").write_text(f"roles: {{train: {{gpus: 4}}}}\nray: {{address: '{cluster.address}'}}\n")
    proc = dualrun("plan", "--backend", "ray", "--config_file", "gpu4.yaml", cwd=job, env=ray_env())
    assert proc.returncode == 0, proc.stderr
    assert "cluster=ray (2 node(s))" in proc.stdout
    assert "node 0 127.0.0.1: 2 GPU(s)" in proc.stdout and "node 1 127.0.0.1: 2 GPU(s)" in proc.stdout
    assert not cluster.alive_actors()


def test_plan_without_a_cluster_starts_none(job):
    env = ray_env()
    proc = dualrun("plan", "--backend", "ray", "--config_file", "cpu2.yaml", cwd=job, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "cluster=planned" in proc.stdout
    assert not pids_matching(env["RAY_TMPDIR"]) and not list(Path(env["RAY_TMPDIR"]).iterdir())


@pytest.mark.ray
@pytest.mark.slow
def test_embedded_cluster_gloo_run(job):
    """No cluster running, no address: an embedded Ray runs a real gloo job and leaves no Ray process behind."""
    env = ray_env()
    (job / "cfg.yaml").write_text(CPU2 + "log_dir: logs\n")
    proc = dualrun("launch", "--backend", "ray", "--config_file", "cfg.yaml", "gloo.py", str(job), cwd=job, env=env)
    assert proc.returncode == 0, proc.stderr
    for rank in (0, 1):
        assert f"[train rank {rank}] rank {rank} sum 3.0 cwd {job}" in proc.stdout
        assert f"[train rank {rank}] to stderr from {rank}" in proc.stderr
        log = (job / "logs" / f"train_{rank}.log").read_text()
        assert f"rank {rank} sum 3.0" in log and f"to stderr from {rank}" in log
    assert "job succeeded" in proc.stderr
    assert eventually(lambda: not pids_matching(env["RAY_TMPDIR"])), pids_matching(env["RAY_TMPDIR"])
    assert not pids_matching(str(job))


def _signal_everyone(pid: int, sig: signal.Signals) -> None:
    """`sig` to `pid` and every process under it at once, as systemd's stop of a unit (KillMode=control-group) or a
    container's stop sends it."""
    import psutil

    everyone = [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]
    assert len(everyone) >= 5, everyone   # the driver, the GCS, the raylet, two ranks' workers at least
    for each in everyone:
        try:
            os.kill(each, sig)
        except ProcessLookupError:
            pass


@pytest.mark.slow
@pytest.mark.parametrize("sent_to,sig,code", [("group", signal.SIGTERM, 143), ("group", signal.SIGINT, 130),
                                              ("every process", signal.SIGTERM, 143)],
                         ids=["group-SIGTERM", "group-SIGINT", "every-process-SIGTERM"])
def test_a_signal_to_the_whole_process_group_stops_an_embedded_cluster_job(job, sent_to, sig, code):
    """`kill -TERM -PGID` (a process supervisor, a shell's job control) and Ctrl-C (the terminal signals the whole
    foreground group) reach the embedded cluster's processes too, unless they run in their own group: a raylet
    killed by it left the driver waiting on Ray for good, with every actor and server running. A signal to every
    process at once ends the embedded cluster's GCS and raylet beside the driver: its teardown finds the cluster
    gone (gang.cluster_gone) instead of waiting on it (it waited 60 s, then Ray ended it: exit 1, no summary)."""
    env = ray_env()
    driver = _sleeping_job(job, env, start_new_session=True)
    try:
        sent = time.monotonic()
        if sent_to == "group":
            os.killpg(driver.pid, sig)   # the driver's group, as the shell or terminal sends it
        else:
            _signal_everyone(driver.pid, sig)
        got = driver.wait(timeout=90)
        took = time.monotonic() - sent
        err = driver.stderr.read()
        assert got == code and took < 20, f"exit {got} after {took:.1f} s\n{err[-3000:]}"
        assert f"dualrun: job failed (exit code {code})" in err and f"stopped by {sig.name}" in err, err[-3000:]
        assert eventually(lambda: not pids_matching(env["RAY_TMPDIR"])), pids_matching(env["RAY_TMPDIR"])
        assert eventually(lambda: not pids_matching(str(job))), pids_matching(str(job))
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()


def test_dry_run_starts_nothing(job):
    env = ray_env()
    proc = dualrun("launch", "--dry_run", "--backend", "ray", "--config_file", "cpu2.yaml", "dump.py", "out",
                   cwd=job, env=dict(env, HF_TOKEN="hf_secret_value"))
    assert proc.returncode == 0, proc.stderr
    assert "backend=ray" in proc.stdout and "nothing was started" in proc.stdout
    assert "MASTER_ADDR='<auto>'" in proc.stdout and "HF_TOKEN='***'" in proc.stdout
    assert "hf_secret_value" not in proc.stdout
    assert "# train rank 1:" in proc.stdout and "RANK=1" in proc.stdout
    assert not list(Path(env["RAY_TMPDIR"]).iterdir())



@pytest.mark.ray
@pytest.mark.slow
def test_embedded_cluster_is_loopback_only_without_dashboard(job):
    """Security: the embedded Ray binds to 127.0.0.1 and starts no dashboard unless `ray.include_dashboard`."""
    import subprocess
    import sys

    env = dict(os.environ, **ray_env())
    (job / "hold.py").write_text("import pathlib, sys, time\npathlib.Path(sys.argv[1], 'up').touch()\ntime.sleep(4)\n")
    (job / "one.yaml").write_text("use_cpu: true\nroles: {train: {gpus: 1}}\n")
    proc = subprocess.Popen([sys.executable, "-m", "dualrun", "launch", "--backend", "ray", "--config_file", "one.yaml",
                             "hold.py", str(job)], cwd=job, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert eventually(lambda: (job / "up").exists(), timeout=120)
        cmds = [cmd for cmd in map(cmdline, pids_matching(env["RAY_TMPDIR"])) if cmd]
        assert any("raylet" in c for c in cmds), cmds
        # without include_dashboard the lean node starts no API server (Ray's `dashboard.py`) at all
        heads = [c for c in cmds if "dashboard/dashboard.py" in c]
        assert heads == [], heads
        ips = {part.split("=", 1)[1] for c in cmds for part in c.split() if part.startswith("--node-ip-address=")}
        assert ips == {"127.0.0.1"}, ips
    finally:
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err


FIRST_THEN_WAIT = """
import os, sys, time
print("first line", flush=False)   # as a script prints: no flush of its own
deadline = time.monotonic() + 30
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.1)
print("the file came" if os.path.exists(sys.argv[1]) else "no file within 30 s")
"""


@pytest.mark.ray
@pytest.mark.slow
def test_a_ranks_print_reaches_the_console_while_it_runs_not_at_its_exit(job, cluster):
    """A rank's stdout is a pipe to its actor: its lines come as printed (as from torchrun), not in one block at its
    exit, whether or not the launching shell set PYTHONUNBUFFERED. The test answers the first line with a file the
    rank waits for."""
    (job / "first.py").write_text(FIRST_THEN_WAIT)
    (job / "one.yaml").write_text("use_cpu: true\nroles: {train: {gpus: 1}}\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env.update(ray_env(RAY_ADDRESS=cluster.address))
    proc = subprocess.Popen([sys.executable, "-m", "dualrun", "launch", "--backend", "ray", "--config_file", "one.yaml",
                             "first.py", str(job / "answer")], cwd=job, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    out = []
    assert proc.stdout is not None
    for line in proc.stdout:
        out.append(line)
        if "[train rank 0] first line" in line:
            (job / "answer").touch()
    assert proc.wait(timeout=60) == 0, "".join(out)[-3000:]
    assert any("[train rank 0] the file came" in line for line in out), "".join(out)[-3000:]
