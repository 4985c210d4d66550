"""The SLURM backend (dualrun/backends/slurm/, plugged in through its entry point): its pure parts, its dry run and
refusals anywhere; real jobs on a one-node SLURM cluster (munged, slurmctld, slurmd on 127.0.0.1) inside `sbatch`,
started only in the loopback-only namespace, skipped with the reason where SLURM is not installed (CI)."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO, dualrun, link_tiny, pids_matching, pids_under
from dualrun.backends.slurm.allocation import parse_hostnames
from dualrun.backends.slurm.steps import failed_tasks, ranks_step, server_step, step_name
from dualrun.backends.slurm.task import env_for, tasks_per_node

SFT = REPO / "examples" / "sft.py"
TASK = "dualrun.backends.slurm.task"


def tasks_of(where: Path, marker: str = TASK) -> list[int]:
    """The srun task shims (or other processes matching `marker`) still running from `where`."""
    return pids_under(where, marker)
NO_SLURM = {k: "" for k in os.environ if k.startswith("SLURM_")}


# -- the pure parts ------------------------------------------------------------------------------------------
def test_hostnames_and_tasks_per_node_parse_slurms_forms():
    assert parse_hostnames("node01\nnode02\n\n") == ("node01", "node02")
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1] and tasks_per_node("4") == [4]


def test_a_task_gets_torchruns_names_from_slurms():
    slurm = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_NUM_TASKS": "4",
             "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "MASTER_ADDR": "n0",
             "MASTER_PORT": "1234", "DUALRUN_SLURM_RANKS": "1", "DUALRUN_SLURM_DEVICES": '["0,1", "2,3"]',
             "DUALRUN_SLURM_ERROR_DIR": "/e"}
    env = env_for(slurm)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES",
                                "TORCHELASTIC_ERROR_FILE")} == {
        "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "n0", "MASTER_PORT": "1234", "CUDA_VISIBLE_DEVICES": "2,3",
        "TORCHELASTIC_ERROR_FILE": "/e/rank3.json"}
    # a server's task: its devices only, no rank variables
    assert env_for({"SLURM_NODEID": "0", "DUALRUN_SLURM_DEVICES": '["5"]'}) == {"CUDA_VISIBLE_DEVICES": "5"}


def test_a_task_routes_toward_another_node_of_the_job():
    from dualrun.backends.slurm.task import NODES, network_here, peer_of

    assert peer_of({NODES: "n0,n1,n2", "SLURMD_NODENAME": "n0"}) == "n1"
    assert peer_of({NODES: "n0,n1", "SLURMD_NODENAME": "n1"}) == "n0"
    assert peer_of({NODES: "n0", "SLURMD_NODENAME": "n0"}) is None and network_here({NODES: "n0"}) == {}


def test_the_srun_lines():
    argv = ranks_step(["a", "b"], 2, ["py", "-m", "dualrun.rank.bootstrap", "s.py"], "dualrun-train-x", "py")
    assert argv[:6] == ["srun", "--job-name=dualrun-train-x", "--nodes=2", "--ntasks=4", "--ntasks-per-node=2",
                        "--nodelist=a,b"]
    assert "--kill-on-bad-exit=1" in argv and "--overlap" in argv
    assert argv[-7:] == ["py", "-m", "dualrun.backends.slurm.task", "py", "-m", "dualrun.rank.bootstrap", "s.py"]
    one = server_step("b", ["py", "-m", "engine"], step_name("teacher server 0", "r1"), "py")
    assert "--nodelist=b" in one and "--ntasks=1" in one and "--job-name=dualrun-teacher-server-0-r1" in one


def test_srun_error_lines_name_the_tasks_in_order():
    lines = ["srun: error: n0: task 1: Exited with exit code 3", "some rank output",
             "srun: error: n0: tasks 0,2-3: Killed", "srun: launch/slurm: _step_signal: Terminating StepId=5.0"]
    assert failed_tasks(lines) == [(1, 3), (0, -9), (2, -9), (3, -9)]


# -- the CLI, no SLURM needed ----------------------------------------------------------------------------------
def test_the_backend_is_installed_through_its_entry_point_not_built_in():
    from dualrun.config.backends import BUILT_IN, installed

    assert "slurm" in installed() and "slurm" not in dict(BUILT_IN)


def test_outside_an_allocation_launch_is_one_line_exit_2(tmp_path):
    (tmp_path / "c.yaml").write_text("use_cpu: true\nroles: {train: {gpus: 2}}\n")
    (tmp_path / "w.py").write_text("open('ran', 'w').write('x')\n")
    r = dualrun("launch", "--backend", "slurm", "--config_file", "c.yaml", "w.py", cwd=tmp_path, env=NO_SLURM)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "not inside a SLURM allocation" in r.stderr and not (tmp_path / "ran").exists()


def test_the_dry_run_shows_the_srun_lines(tmp_path):
    (tmp_path / "c.yaml").write_text("use_cpu: true\nmethod: gkd\nroles:\n  train: {gpus: 2}\n"
                                     "  teacher: {gpus: 1, model: t, engine: transformers, top_k: 5}\n")
    (tmp_path / "t").mkdir()
    (tmp_path / "w.py").write_text("")
    r = dualrun("launch", "--backend", "slurm", "--config_file", "c.yaml", "--dry_run", "w.py", "--a", "1",
                cwd=tmp_path, env=NO_SLURM)
    assert r.returncode == 0, r.stderr
    ranks = [ln for ln in r.stdout.splitlines() if ln.strip().startswith("srun ")]
    assert len(ranks) == 1 and "--ntasks=2" in ranks[0] and "dualrun.rank.bootstrap w.py --a 1" in ranks[0], r.stdout
    teacher = [ln for ln in r.stdout.splitlines() if ln.startswith("# teacher server 0, started beside the trainers:")]
    assert teacher and "srun --job-name=dualrun-teacher-server-0-" in teacher[0] and "'--nodelist=<node 0>'" in \
        teacher[0], r.stdout
    plan = dualrun("plan", "--backend", "slurm", "--config_file", "c.yaml", cwd=tmp_path, env=NO_SLURM)
    assert plan.returncode == 0 and plan.stdout.startswith("plan: backend=slurm method=gkd"), plan.stderr
    srun = [ln.strip() for ln in plan.stdout.splitlines() if "srun --job-name=dualrun-" in ln]
    assert len(srun) == 2 and "--ntasks=2" in srun[1] and srun[1].endswith("dualrun.rank.bootstrap SCRIPT"), srun
    assert "srun" not in dualrun("plan", "--backend", "torchrun", "--config_file", "c.yaml", cwd=tmp_path).stdout


# -- real jobs inside sbatch -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def slurm():
    from slurm_helpers import one_node_slurm

    with one_node_slurm("drsb") as cluster:
        yield cluster


def _job_script(tmp_path: Path, *launch: str) -> Path:
    """tmp_path/job.sh: `dualrun launch --backend slurm LAUNCH`, from tmp_path, as an sbatch script's one command."""
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\ncd {tmp_path}\nexec {sys.executable} -m dualrun launch --backend slurm "
                      + " ".join(launch) + "\n")
    return script


def _in_sbatch(slurm, tmp_path: Path, *launch: str, timeout: float = 600) -> tuple[int, str, float]:
    """`dualrun launch --backend slurm ...` as an sbatch script's one command: (exit code, its output, seconds)."""
    script = _job_script(tmp_path, *launch)
    start = time.monotonic()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    code, log = slurm.sbatch(script, "--nodes=1", "--ntasks=2", env=env, cwd=tmp_path, timeout=timeout)
    return code, log, time.monotonic() - start


def _submitted(slurm, tmp_path: Path, *launch: str) -> tuple[str, dict[str, str], Path]:
    """The same, submitted without waiting: (the job's id, the env SLURM's commands take, its output file)."""
    import subprocess

    script = _job_script(tmp_path, *launch)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, "SLURM_CONF": slurm.env["SLURM_CONF"]}
    log = tmp_path / "out.log"
    job = subprocess.run(["sbatch", "--parsable", "--nodes=1", "--ntasks=2", "-o", str(log), str(script)], env=env,
                         capture_output=True, text=True, check=True).stdout.strip()
    return job, env, log


def _queued(job: str, env: dict[str, str]) -> bool:
    """Whether SLURM still lists the job."""
    import subprocess

    return bool(subprocess.run(["squeue", "-h", "-j", job], env=env, capture_output=True, text=True).stdout.strip())


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sft_on_slurm_has_the_losses_of_torchrun(slurm, tiny, tmp_path):
    link_tiny(tiny, tmp_path)
    (tmp_path / "cpu2.yaml").write_text("use_cpu: true\nroles: {train: {gpus: 2}}\n")
    args = [str(SFT), "--model_name_or_path", str(tmp_path / "tiny" / "model"), "--dataset_path",
            "tiny/data/sft.jsonl", "--seed", "7", "--save_strategy", "no", "--max_steps", "4"]
    losses = {}
    code, log, _ = _in_sbatch(slurm, tmp_path, "--config_file", "cpu2.yaml", *args, "--output_dir", "out_slurm")
    assert code == 0, log[-5000:] + slurm.logs()
    assert "srun" in log and "job succeeded" in log, log[-3000:]
    proc = dualrun("launch", "--backend", "torchrun", "--config_file", "cpu2.yaml", *args, "--output_dir",
                   "out_torchrun", cwd=tmp_path, env=NO_SLURM, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for backend in ("slurm", "torchrun"):
        history = json.loads((tmp_path / f"out_{backend}" / "trainer_state.json").read_text())["log_history"]
        losses[backend] = [h["loss"] for h in history if "loss" in h]
    assert len(losses["slurm"]) >= 2 and losses["slurm"] == losses["torchrun"], losses
    assert not pids_matching(str(tmp_path))


KILLED = """
import os, sys, time
if os.environ["RANK"] == "1":
    time.sleep(3)
    sys.exit(3)
time.sleep(600)
"""


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_failed_rank_ends_the_job_naming_it_and_leaves_nothing(slurm, tmp_path):
    (tmp_path / "c.yaml").write_text("use_cpu: true\nroles: {train: {gpus: 2}}\n")
    (tmp_path / "w.py").write_text(KILLED)
    code, log, took = _in_sbatch(slurm, tmp_path, "--config_file", "c.yaml", "w.py", timeout=240)
    assert code != 0 and "train rank 1 failed (exit code 3)" in log, log[-4000:]
    assert took < 60, (took, log[-3000:])
    assert not pids_matching(str(tmp_path / "w.py")) and not tasks_of(tmp_path), \
        "a rank outlived the job"


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gkd_with_the_teacher_as_its_own_srun_step_has_torchruns_losses(slurm, tiny, tmp_path):
    link_tiny(tiny, tmp_path)
    (tmp_path / "gkd.yaml").write_text((REPO / "configs" / "gkd_cpu_separate_teacher.yaml").read_text())
    args = [str(REPO / "examples" / "gkd.py"), "--model_name_or_path", "tiny/model", "--dataset_path",
            "tiny/data/gkd.jsonl", "--seed", "3", "--save_strategy", "no", "--max_steps", "3"]
    code, log, _ = _in_sbatch(slurm, tmp_path, "--config_file", "gkd.yaml", *args, "--output_dir", "out_slurm")
    assert code == 0, log[-5000:] + slurm.logs()
    assert "srun --job-name=dualrun-teacher-server-0-" not in log   # the step runs, it is not echoed
    assert "[teacher server 0] dualrun engine: serving" in log and "GKD teacher served by the teacher role" in log, \
        log[-4000:]
    proc = dualrun("launch", "--backend", "torchrun", "--config_file", "gkd.yaml", *args, "--output_dir",
                   "out_torchrun", cwd=tmp_path, env=NO_SLURM, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = {b: [h["loss"] for h in json.loads((tmp_path / f"out_{b}" / "trainer_state.json").read_text())
                  ["log_history"] if "loss" in h] for b in ("slurm", "torchrun")}
    assert len(losses["slurm"]) == 3 and losses["slurm"] == losses["torchrun"], losses
    assert not tasks_of(tmp_path), "the teacher server (or a rank) outlived the job"


SLEEPS = """
import os, sys, time
open(os.path.join(sys.argv[1], "rank" + os.environ["RANK"]), "w").close()
time.sleep(600)
"""


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_scancel_leaves_no_process(slurm, tmp_path):
    import subprocess

    (tmp_path / "c.yaml").write_text("use_cpu: true\nroles: {train: {gpus: 2}}\n")
    (tmp_path / "w.py").write_text(SLEEPS)
    job, env, log = _submitted(slurm, tmp_path, "--config_file", "c.yaml", "w.py", str(tmp_path))
    deadline = time.monotonic() + 120
    while not ((tmp_path / "rank0").exists() and (tmp_path / "rank1").exists()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert (tmp_path / "rank1").exists(), log.read_text()[-3000:] + slurm.logs()
    subprocess.run(["scancel", job], env=env, check=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (_queued(job, env) or tasks_of(tmp_path)):
        time.sleep(0.5)
    assert not tasks_of(tmp_path), "a rank outlived scancel"
    assert not pids_matching(str(tmp_path / "job.sh")) and not tasks_of(tmp_path, "dualrun-train-"), \
        "the launcher or srun outlived it"


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_asks_the_allocations_nodes(slurm, tmp_path):
    (tmp_path / "c.yaml").write_text("use_cpu: true\nroles: {train: {gpus: 2}}\n")
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\ncd {tmp_path}\nexec {sys.executable} -m dualrun check --backend slurm "
                      "--config_file c.yaml\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    code, log = slurm.sbatch(script, "--nodes=1", "--ntasks=2", env=env, cwd=tmp_path, timeout=240)
    assert code == 0 and "node 0 localhost" in log, log[-3000:]


# -- --submit: from outside any allocation ---------------------------------------------------------------------
def test_submit_dry_run_prints_the_batch_script_the_plan_needs(tmp_path):
    (tmp_path / "c.yaml").write_text("use_cpu: true\nnum_machines: 2\nroles: {train: {gpus: 4}}\n")
    (tmp_path / "w.py").write_text("")
    r = dualrun("launch", "--backend", "slurm", "--submit", "--dry_run", "--config_file", "c.yaml", "w.py",
                "--submit", cwd=tmp_path, env=NO_SLURM)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "#SBATCH --nodes=2" in lines and "#SBATCH --ntasks-per-node=2" in lines, r.stdout
    assert lines[-1].endswith("-m dualrun launch --backend slurm --config_file c.yaml w.py --submit"), lines[-1]
    assert not list(tmp_path.glob("*.sbatch")), "a dry run wrote the script"
    other = dualrun("launch", "--backend", "torchrun", "--submit", "--config_file", "c.yaml", "w.py", cwd=tmp_path)
    assert other.returncode == 2 and other.stderr.count("\n") == 1 and "--submit: expected a backend with a batch " \
        "scheduler to submit to (slurm), got --backend torchrun" in other.stderr, other.stderr


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_submit_from_outside_the_allocation_follows_the_job_and_returns_its_code(slurm, tiny, tmp_path):
    """The one command from a login node: the script written, sbatch'd, its output followed here, the training's
    result on disk; a job whose rank fails gives its exit code back."""
    link_tiny(tiny, tmp_path)
    (tmp_path / "cpu2.yaml").write_text("use_cpu: true\nroles: {train: {gpus: 2}}\n")
    env = {**NO_SLURM, "SLURM_CONF": slurm.env["SLURM_CONF"]}
    r = dualrun("launch", "--backend", "slurm", "--submit", "--config_file", "cpu2.yaml", str(SFT),
                "--model_name_or_path", str(tmp_path / "tiny" / "model"), "--dataset_path", "tiny/data/sft.jsonl",
                "--save_strategy", "no", "--max_steps", "2", "--output_dir", "out", cwd=tmp_path, env=env,
                timeout=500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:] + slurm.logs()
    assert "submitted SLURM job" in r.stderr and "job succeeded" in r.stdout and "completed (exit code 0)" in \
        r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
    assert json.loads((tmp_path / "out" / "trainer_state.json").read_text())["global_step"] == 2
    assert len(list(tmp_path.glob("dualrun-slurm-*.sbatch"))) == 1
    (tmp_path / "w.py").write_text(KILLED)
    failed = dualrun("launch", "--backend", "slurm", "--submit", "--config_file", "cpu2.yaml", "w.py", cwd=tmp_path,
                     env=env, timeout=240)
    assert failed.returncode == 3 and "train rank 1 failed (exit code 3)" in failed.stdout, \
        failed.stdout[-3000:] + failed.stderr[-2000:]
    assert not tasks_of(tmp_path)


RESTARTED = """
import os, sys, time
if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":   # the second attempt: done
    sys.exit(0)
time.sleep(600)
"""


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_dead_teacher_server_restarts_the_job_with_fresh_servers(slurm, tiny, tmp_path):
    """The teacher's srun step killed mid-job (its engine SIGKILLed on its node): the launcher names it and, with
    `max_failures: 1`, starts the job again with a fresh server step; the second attempt ends the job, nothing
    left."""
    import signal

    link_tiny(tiny, tmp_path)
    (tmp_path / "gkd.yaml").write_text(
        "use_cpu: true\nmethod: gkd\nmax_failures: 1\nroles:\n  train: {gpus: 2}\n"
        f"  teacher: {{gpus: 1, model: {tmp_path / 'tiny' / 'teacher'}, engine: transformers, top_k: 5, "
        "health_timeout_s: 120}\n")
    (tmp_path / "w.py").write_text(RESTARTED)
    job, env, log = _submitted(slurm, tmp_path, "--config_file", "gkd.yaml", "w.py")
    engine = str(tmp_path / "tiny" / "teacher")
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not ("server healthy" in (log.read_text() if log.exists() else "")
                                               and pids_matching(engine, "cpu_engine")):
        time.sleep(0.5)
    first = pids_matching(engine, "cpu_engine")
    assert first, (log.read_text() if log.exists() else "") + slurm.logs()
    for pid in first:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and _queued(job, env):
        time.sleep(0.5)
    text = log.read_text()
    assert "teacher server 0" in text and "restarting the job with fresh servers (1/1)" in text, text[-4000:]
    assert "job succeeded" in text, text[-4000:]
    assert not pids_matching(engine) and not tasks_of(tmp_path), "left after the job"


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ctrl_c_while_following_a_submitted_job_cancels_it(slurm, tmp_path):
    """`--submit`'s follower interrupted (SIGINT, as Ctrl-C): exit 130, the job cancelled, none of its processes
    left."""
    import signal
    import subprocess

    (tmp_path / "c.yaml").write_text("use_cpu: true\nroles: {train: {gpus: 2}}\n")
    (tmp_path / "w.py").write_text(SLEEPS)
    env = {**os.environ, **NO_SLURM, "SLURM_CONF": slurm.env["SLURM_CONF"]}
    follower = subprocess.Popen([sys.executable, "-m", "dualrun", "launch", "--backend", "slurm", "--submit",
                                 "--config_file", "c.yaml", "w.py", str(tmp_path)], cwd=tmp_path, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "rank1").exists() and time.monotonic() < deadline and follower.poll() is None:
            time.sleep(0.5)
        assert (tmp_path / "rank1").exists(), slurm.logs()
        follower.send_signal(signal.SIGINT)
        out, err = follower.communicate(timeout=60)
    finally:
        if follower.poll() is None:
            follower.kill()
    job = err.split("submitted SLURM job ", 1)[1].split()[0]
    assert follower.returncode == 130 and f"cancelled SLURM job {job}" in err, err[-3000:]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (_queued(job, env) or tasks_of(tmp_path)):
        time.sleep(0.5)
    assert not _queued(job, env) and not tasks_of(tmp_path), "the cancelled job left processes"
