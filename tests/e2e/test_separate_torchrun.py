"""Separate roles under torchrun, real processes on loopback, when things go wrong: a server that never gets healthy,
a trainer crash; and the dry run's server command. (A GKD teacher served by its own process trains in
test_methods.py[gkd_separate_teacher] and, through replicas, test_replicas_e2e.py; GRPO's server-mode wiring is
checked in test_group_ports.py.)"""
from __future__ import annotations

from pathlib import Path

import pytest

from helpers import ASSETS, dualrun, engine_pid, gone

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def _gkd(tmp_path: Path, tiny: Path, config: str, *extra: str):
    (tmp_path / "job.yaml").write_text(config)
    (tmp_path / "out").mkdir(exist_ok=True)
    return dualrun("launch", "--config_file", "job.yaml", str(ASSETS / "gkd_probe.py"),
                   "--model_name_or_path", str(tiny / "model"), "--teacher_model_name_or_path", str(tiny / "teacher"),
                   "--data", str(tiny / "data" / "gkd.jsonl"), "--output_dir", "out", *extra, cwd=tmp_path,
                   env={"TRL_EXPERIMENTAL_SILENCE": "1"})


def _teacher_yaml(tiny: Path, **extra: str) -> str:
    more = "".join(f", {k}: {v}" for k, v in extra.items())
    return ("use_cpu: true\nmethod: gkd\nroles:\n  train: {gpus: 2}\n"
            f"  teacher: {{gpus: 1, model: {tiny / 'teacher'}, top_k: 5, health_timeout_s: 90{more}}}\n")


@pytest.mark.slow
def test_a_trainer_crash_stops_the_server(tmp_path, module_tiny):
    proc = _gkd(tmp_path, module_tiny, _teacher_yaml(module_tiny), "--max_steps", "3", "--crash_at_step", "1")
    assert proc.returncode != 0
    assert "crashed on purpose" in proc.stderr
    assert gone(engine_pid(proc.stderr, "teacher server 0"))


@pytest.mark.slow
def test_a_server_that_never_gets_healthy_fails_the_job_with_its_log(tmp_path, module_tiny):
    cfg = _teacher_yaml(module_tiny).replace("health_timeout_s: 90",
                                             "health_timeout_s: 3, server_args: [--startup-delay, 60]")
    proc = _gkd(tmp_path, module_tiny, cfg)
    assert proc.returncode == 1
    assert "teacher server 0 did not become healthy within 3 s" in proc.stderr
    assert "--- last lines of its log ---" in proc.stderr and "dualrun engine: loading" in proc.stderr
    assert not list((tmp_path / "out").glob("rank*.json"))
    assert gone(engine_pid(proc.stderr, "teacher server 0"))


def test_dry_run_shows_the_server_command(tmp_path, module_tiny):
    (tmp_path / "job.yaml").write_text(
        "method: gkd\nroles:\n  train: {gpus: 2}\n  teacher: {gpus: 1, model: m/teacher, top_k: 20}\n")
    (tmp_path / "t.py").write_text("")
    proc = dualrun("launch", "--config_file", "job.yaml", "--dry_run", "t.py", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("# teacher server 0"))
    assert "CUDA_VISIBLE_DEVICES=2" in line and "vllm.entrypoints.cli.main serve m/teacher" in line
    assert "--max-logprobs -1" in line
