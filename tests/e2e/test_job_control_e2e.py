"""A job's control channel ends with the job on every path: a torchrun launch of GKD whose teacher fleet is
resizable registers itself (the registry file, the line) and, stopped by SIGTERM or Ctrl-C while it trains, leaves
no registry file, no engine, and `dualrun scale` finds no job."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from helpers import ASSETS, eventually
from test_replicas_e2e import _engines

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signalled_launch_leaves_no_registry_file(tmp_path, module_tiny, sig):
    tiny = module_tiny
    (tmp_path / "job.yaml").write_text(
        "use_cpu: true\nmethod: gkd\nlog_dir: logs\nroles:\n  train: {gpus: 1}\n"
        f"  teacher: {{gpus: 1, max_replicas: 2, model: {tiny / 'teacher'}, top_k: 5, health_timeout_s: 120}}\n")
    (tmp_path / "out").mkdir()
    (tmp_path / "gate").touch()
    jobs = tmp_path / "jobs"
    env = dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1", DUALRUN_JOBS_DIR=str(jobs))
    with open(tmp_path / "stderr.txt", "w") as errors:
        driver = subprocess.Popen([sys.executable, "-m", "dualrun", "launch", "--backend", "torchrun",
                                   "--config_file", "job.yaml", str(ASSETS / "gkd_probe.py"),
                                   "--model_name_or_path", str(tiny / "model"), "--teacher_model_name_or_path",
                                   str(tiny / "teacher"), "--data", str(tiny / "data" / "gkd.jsonl"), "--output_dir",
                                   "out", "--max_steps", "4", "--hold_file", str(tmp_path / "gate"),
                                   "--hold_at_step", "1"],
                                  cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=errors, text=True)
    stderr = lambda: (tmp_path / "stderr.txt").read_text()  # noqa: E731
    try:
        assert eventually(lambda: driver.poll() is not None or (tmp_path / "gate.held0").exists(), timeout=200), \
            stderr()[-3000:]
        assert driver.poll() is None, stderr()[-3000:]
        files = list(jobs.glob("*.json"))
        assert len(files) == 1, stderr()[-3000:]
        record = json.loads(files[0].read_text())
        assert record["pid"] == driver.pid and record["roles"] == {"teacher": {"replicas": 1, "min": 1, "max": 2}}
        assert record["config"] == str(tmp_path / "job.yaml")
        assert f"dualrun: job {record['run_id']}: resize a fleet with `dualrun scale ROLE N` (teacher: 1 now, 1-2)" \
            in stderr()
        driver.send_signal(sig)
        code = driver.wait(timeout=120)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert code == 128 + sig, stderr()[-3000:]
    assert not list(jobs.glob("*.json"))
    assert eventually(lambda: not _engines(tiny)), _engines(tiny)
    r = subprocess.run([sys.executable, "-m", "dualrun", "scale", "teacher", "2"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "no dualrun job" in r.stderr, r
