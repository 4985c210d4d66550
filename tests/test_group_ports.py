"""Three jobs with rollout servers started at once on one machine (two on torchrun, one on Ray) each get their own
free weight-sync port (`vllm_group_port`) instead of TRL's shared default 51216, filled into the unchanged
GRPOConfig like the server's address."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ray_helpers import ray_env

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]

PROBE = Path(__file__).resolve().parent / "assets" / "grpo_wiring_probe.py"
TRL_DEFAULT = 51216


def test_concurrent_jobs_get_distinct_weight_sync_ports(tmp_path_factory, tiny, ray_cluster):
    root = tmp_path_factory.mktemp("ports")
    (root / "job.yaml").write_text(
        "use_cpu: true\nmethod: grpo\nroles:\n  train: {gpus: 1}\n"
        f"  rollout: {{gpus: 1, model: {tiny / 'model'}, engine: transformers, health_timeout_s: 120}}\n")
    args = json.dumps(["--output_dir", "o", "--report_to", "none", "--use_cpu", "true"])
    jobs = []
    for j, backend in enumerate(("torchrun", "torchrun", "ray")):
        out = root / f"job{j}"
        out.mkdir()
        env = dict(os.environ, **ray_env(RAY_ADDRESS=ray_cluster.address))
        jobs.append((out, subprocess.Popen(
            [sys.executable, "-m", "dualrun", "launch", "--backend", backend, "--config_file", "job.yaml",
             str(PROBE), str(out), args], cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True)))
    ports = []
    for out, proc in jobs:
        log, _ = proc.communicate(timeout=280)
        assert proc.returncode == 0, log[-3000:]
        rec = json.loads((out / "rank0.json").read_text())["default"]
        assert rec["vllm_mode"] == "server" and rec["vllm_group_port"] != TRL_DEFAULT
        ports.append(rec["vllm_group_port"])
    assert len(set(ports)) == 3, ports
