"""`dualrun scale` against a running job (torchrun, one machine): a GKD teacher fleet grows 1 -> 2 while TRL's
GKDTrainer trains, serves with both, shrinks back to 1, and the job ends 0 with the losses of the same job on a
fixed fleet (the teacher is deterministic whichever replica answers); out-of-bounds asks are one line and exit 2;
nothing is left. The trainers wait at two gates (after steps 2 and 4) so that each resize happens mid-run on 2
busy cores."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ASSETS, eventually
from test_replicas_e2e import RESTART_STEPS, _engines, _losses, unkilled  # noqa: F401 - the fixed fleet's losses

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]


def _scale(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, DUALRUN_JOBS_DIR=str(tmp_path / "jobs"))
    return subprocess.run([sys.executable, "-m", "dualrun", "scale", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)


def _held(tmp_path: Path, step: int) -> bool:
    return all(Path(f"{tmp_path / 'gate'}.{step}.held{r}").exists() for r in (0, 1))


def test_a_teacher_fleet_grows_and_shrinks_while_gkd_trains_with_the_fixed_fleets_losses(tmp_path, module_tiny,
                                                                                          unkilled):  # noqa: F811
    tiny = module_tiny
    (tmp_path / "job.yaml").write_text(
        "use_cpu: true\nmethod: gkd\nlog_dir: logs\nroles:\n  train: {gpus: 2}\n"
        f"  teacher: {{gpus: 1, max_replicas: 2, model: {tiny / 'teacher'}, top_k: 5, health_timeout_s: 120, "
        "server_args: [--verbose]}\n")
    (tmp_path / "out").mkdir()
    for step in (2, 4):
        Path(f"{tmp_path / 'gate'}.{step}").touch()
    env = dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1", DUALRUN_JOBS_DIR=str(tmp_path / "jobs"))
    stderr = lambda: (tmp_path / "stderr.txt").read_text()  # noqa: E731
    with open(tmp_path / "stderr.txt", "w") as errors:
        driver = subprocess.Popen([sys.executable, "-m", "dualrun", "launch", "--backend", "torchrun",
                                   "--config_file", "job.yaml", str(ASSETS / "gkd_probe.py"),
                                   "--model_name_or_path", str(tiny / "model"), "--teacher_model_name_or_path",
                                   str(tiny / "teacher"), "--data", str(tiny / "data" / "gkd.jsonl"), "--output_dir",
                                   "out", "--max_steps", str(RESTART_STEPS), "--hold_file", str(tmp_path / "gate"),
                                   "--hold_steps", "2,4"],
                                  cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=errors, text=True)
    try:
        assert eventually(lambda: driver.poll() is not None or _held(tmp_path, 2), timeout=200), stderr()[-3000:]
        assert driver.poll() is None, stderr()[-3000:]
        assert re.search(r"dualrun: job dualrun-\w+: .*dualrun scale", stderr()), stderr()[-3000:]
        for n in ("3", "0"):   # out of its bounds (min 1, max 2): one line, exit 2, nothing changed
            r = _scale(tmp_path, "teacher", n)
            assert r.returncode == 2 and "out of its bounds" in r.stdout + r.stderr, (r.stdout, r.stderr)
        r = _scale(tmp_path, "teacher", "2")
        assert r.returncode == 0 and "teacher: 2 replicas now" in r.stdout + r.stderr, (r.stdout, r.stderr)
        # the trainers wait after step 2: their last teacher request was of step 1 (its global step while it
        # computed the second), the grown teacher's first is of a later one, which no one knows before it comes
        assert re.search(r"dualrun: teacher server 1 joined at 127\.0\.0\.1:\d+, serving from the trainer's next "
                         r"request \(its last was of step 1\), [\d.]+ s after the resize", stderr()), stderr()[-3000:]
        os.unlink(f"{tmp_path / 'gate'}.2")   # steps 3 and 4 on two replicas
        assert eventually(lambda: driver.poll() is not None or _held(tmp_path, 4), timeout=200), stderr()[-3000:]
        served = (tmp_path / "logs" / "teacher-server-1.log").read_text().count('"POST /v1/completions')
        assert served >= 1, "the grown replica served no request"
        r = _scale(tmp_path, "teacher", "1")
        assert r.returncode == 0 and "teacher: 1 replicas now" in r.stdout + r.stderr, (r.stdout, r.stderr)
        assert "dualrun: teacher server 1 left (scaled down); 1 of min 1 remain" in stderr()
        os.unlink(f"{tmp_path / 'gate'}.4")   # steps 5 and 6 on one again
        code = driver.wait(timeout=200)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert code == 0, stderr()[-3000:]
    # the job's summary: the step of the first request the grown teacher answered (steps 3 and 4 ran on two
    # replicas, at global steps 2 and 3)
    assert re.search(r"dualrun: fleet: teacher server 1 joined [\d.]+ s after the resize asked for it \(its engine "
                     r"started in [\d.]+ s\), serving from step [23]; teacher server 1 left \(scaled down\)\n",
                     stderr()), stderr()[-3000:]
    assert _losses(tmp_path, RESTART_STEPS) == unkilled["losses"]
    assert eventually(lambda: not _engines(tiny)), _engines(tiny)   # every engine stopped with the job
    assert not list((tmp_path / "jobs").glob("*.json"))             # the job's control left nothing behind
    r = _scale(tmp_path, "teacher", "2")
    assert r.returncode == 2 and "no dualrun job" in r.stdout + r.stderr, (r.stdout, r.stderr)
