"""Separate roles under torchrun, real processes on loopback: a GKD teacher served by its own process (the CPU
engine), GRPO's vLLM server-mode wiring, a server that never gets healthy, a trainer crash."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import dualrun, link_tiny
from helpers import gone

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

ASSETS = Path(__file__).resolve().parent / "assets"


@pytest.fixture(scope="module")
def tiny(tiny, tmp_path_factory) -> Path:
    """The shared assets under this module's own path: the teacher's path on a command line marks this module's
    servers (see conftest.link_tiny)."""
    return link_tiny(tiny, tmp_path_factory.mktemp("assets"))


def _gkd(tmp_path: Path, tiny: Path, config: str, *extra: str):
    (tmp_path / "job.yaml").write_text(config)
    (tmp_path / "out").mkdir(exist_ok=True)
    return dualrun("launch", "--config_file", "job.yaml", str(ASSETS / "gkd_probe.py"),
                   "--model_name_or_path", str(tiny / "model"), "--teacher_model_name_or_path", str(tiny / "teacher"),
                   "--data", str(tiny / "data" / "gkd.jsonl"), "--output_dir", "out", *extra, cwd=tmp_path,
                   env={"TRL_EXPERIMENTAL_SILENCE": "1"})


def _server_pid(stderr: str) -> int:
    return int(re.search(r"\[teacher server 0\] dualrun engine: loading .* \(pid (\d+)\)", stderr).group(1))


def _teacher_yaml(tiny: Path, **extra: str) -> str:
    more = "".join(f", {k}: {v}" for k, v in extra.items())
    return ("use_cpu: true\nmethod: gkd\nroles:\n  train: {gpus: 2}\n"
            f"  teacher: {{gpus: 1, model: {tiny / 'teacher'}, top_k: 5, health_timeout_s: 90{more}}}\n")


@pytest.mark.slow
def test_gkd_with_a_separate_teacher_trains_and_cleans_up(tmp_path, tiny):
    proc = _gkd(tmp_path, tiny, _teacher_yaml(tiny))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / "out" / f"rank{i}.json").read_text()) for i in range(2)]
    address = ranks[0]["teacher_address"]
    assert re.fullmatch(r"127\.0\.0\.1:\d+", address)
    for r in ranks:
        assert r["teacher"] == "RemoteTeacher" and r["teacher_address"] == address
        assert len(r["losses"]) == 2 and all(x == x and x >= 0 for x in r["losses"])  # finite, trained
    assert ranks[0]["losses"] == ranks[1]["losses"]  # DDP: one loss
    assert f"served by the teacher role at {address} (top-5" in proc.stderr
    assert gone(_server_pid(proc.stderr)), "the teacher server must be stopped after the job"
    assert "job succeeded" in proc.stderr


@pytest.mark.slow
def test_a_trainer_crash_stops_the_server(tmp_path, tiny):
    proc = _gkd(tmp_path, tiny, _teacher_yaml(tiny), "--max_steps", "3", "--crash_at_step", "1")
    assert proc.returncode != 0
    assert "crashed on purpose" in proc.stderr
    assert gone(_server_pid(proc.stderr))


@pytest.mark.slow
def test_a_server_that_never_gets_healthy_fails_the_job_with_its_log(tmp_path, tiny):
    cfg = _teacher_yaml(tiny).replace("health_timeout_s: 90", "health_timeout_s: 3, server_args: [--startup-delay, 60]")
    proc = _gkd(tmp_path, tiny, cfg)
    assert proc.returncode == 1
    assert "teacher server 0 did not become healthy within 3 s" in proc.stderr
    assert "--- last lines of its log ---" in proc.stderr and "dualrun engine: loading" in proc.stderr
    assert not list((tmp_path / "out").glob("rank*.json"))
    assert gone(_server_pid(proc.stderr))


@pytest.mark.slow
def test_grpo_server_mode_wiring(tmp_path, tiny):
    """The fields the unchanged GRPOConfig ends with: the rollout server's host/port and server mode, only where
    the user left the defaults; the address answers; the server runs on other devices than the trainer."""
    (tmp_path / "job.yaml").write_text(
        "use_cpu: true\nmethod: grpo\nroles:\n  train: {gpus: 1}\n"
        f"  rollout: {{gpus: 1, model: {tiny / 'model'}, engine: transformers, health_timeout_s: 90}}\n")
    (tmp_path / "out").mkdir()
    proc = dualrun("launch", "--config_file", "job.yaml", str(ASSETS / "grpo_wiring_probe.py"), "out",
                   json.dumps(["--output_dir", "o", "--report_to", "none", "--use_cpu", "true", "--vllm_mode",
                               "colocate"]), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads((tmp_path / "out" / "rank0.json").read_text())
    host, port = rec["default"]["vllm_server_host"], rec["default"]["vllm_server_port"]
    assert host == "127.0.0.1" and isinstance(port, int) and port != 8000
    group = rec["default"]["vllm_group_port"]
    assert group != 51216 and group != port  # a free weight-sync port of this job, not TRL's shared default
    assert rec["default"] == {"use_vllm": True, "vllm_mode": "server", "vllm_server_host": host,
                              "vllm_server_port": port, "vllm_group_port": group}
    assert rec["explicit"] == {"use_vllm": False, "vllm_mode": "server", "vllm_server_host": host,
                               "vllm_server_port": 9000, "vllm_group_port": group}
    assert rec["parsed"] == {"use_vllm": True, "vllm_mode": "colocate", "vllm_server_host": host,
                             "vllm_server_port": port, "vllm_group_port": group}
    assert rec["health"] == 200
    assert "[rollout server 0] dualrun engine: serving" in proc.stderr


def test_dry_run_shows_the_server_command(tmp_path, tiny):
    (tmp_path / "job.yaml").write_text(
        "method: gkd\nroles:\n  train: {gpus: 2}\n  teacher: {gpus: 1, model: /m/teacher, top_k: 20}\n")
    (tmp_path / "t.py").write_text("")
    proc = dualrun("launch", "--config_file", "job.yaml", "--dry_run", "t.py", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("# teacher server 0"))
    assert "CUDA_VISIBLE_DEVICES=2" in line and "vllm.entrypoints.cli.main serve /m/teacher" in line
    assert "--max-logprobs -1" in line
