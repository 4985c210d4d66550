"""Three jobs with rollout servers started at once on one machine (two on torchrun, one on Ray) each get their own
free weight-sync port (`vllm_group_port`) instead of TRL's shared default 51216, filled into the unchanged
GRPOConfig like the server's address (and, every process being on this host, the weight-sync address on loopback:
VLLM_HOST_IP=127.0.0.1), only where the user left the defaults (a config whose script turned vLLM off
gets nothing, and one line saying the server is unused); the address answers."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import ASSETS
from ray_helpers import ray_env

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]

PROBE = ASSETS / "grpo_wiring_probe.py"
TRL_DEFAULT = 51216


def _assert_wired(rec: dict) -> int:
    """The fields each GRPOConfig of grpo_wiring_probe.py ended with (defaults, explicit kwargs, TrlParser over
    `--vllm_mode colocate`): the rollout server's host/port and server mode where the user left the defaults, and
    a free weight-sync port of this job. That port."""
    host, port = rec["default"]["vllm_server_host"], rec["default"]["vllm_server_port"]
    assert host == "127.0.0.1" and isinstance(port, int) and port != 8000
    group = rec["default"]["vllm_group_port"]
    assert group != TRL_DEFAULT and group != port
    assert rec["default"] == {"use_vllm": True, "vllm_mode": "server", "vllm_server_host": host,
                              "vllm_server_port": port, "vllm_group_port": group}
    # the script turned vLLM off itself: it keeps TRL's defaults and its own values (it is told the server is unused)
    assert rec["explicit"] == {"use_vllm": False, "vllm_mode": "colocate", "vllm_server_host": "0.0.0.0",
                               "vllm_server_port": 9000, "vllm_group_port": TRL_DEFAULT}
    assert rec["parsed"] == {"use_vllm": True, "vllm_mode": "colocate", "vllm_server_host": host,
                             "vllm_server_port": port, "vllm_group_port": group}
    assert rec["health"] == 200
    return group


def test_concurrent_jobs_get_distinct_weight_sync_ports(tmp_path_factory, tiny, ray_cluster):
    root = tmp_path_factory.mktemp("ports")
    (root / "job.yaml").write_text(
        "use_cpu: true\nmethod: grpo\nroles:\n  train: {gpus: 1}\n"
        f"  rollout: {{gpus: 1, model: {tiny / 'model'}, engine: transformers, health_timeout_s: 120}}\n")
    args = json.dumps(["--output_dir", "o", "--report_to", "none", "--use_cpu", "true", "--vllm_mode", "colocate"])
    jobs = []
    for j, backend in enumerate(("torchrun", "torchrun", "ray")):
        out = root / f"job{j}"
        out.mkdir()
        env = dict(os.environ, **ray_env(RAY_ADDRESS=ray_cluster.address))
        jobs.append((backend, out, subprocess.Popen(
            [sys.executable, "-m", "dualrun", "launch", "--backend", backend, "--config_file", "job.yaml",
             str(PROBE), str(out), args], cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True)))
    ports = []
    for backend, out, proc in jobs:
        log, _ = proc.communicate(timeout=280)
        assert proc.returncode == 0, log[-3000:]
        rec = json.loads((out / "rank0.json").read_text())
        ports.append(_assert_wired(rec))
        assert rec["vllm_host_ip"] == "127.0.0.1", backend   # one host: the weight-sync store on loopback alone
        assert "(roles.rollout) is unused: GRPOConfig.use_vllm=False is set by the script" in log, log[-3000:]
        if backend == "torchrun":   # (on Ray a server's output goes to its log file only)
            assert "[rollout server 0] dualrun engine: serving" in log
    assert len(set(ports)) == 3, ports
    ray_cluster.assert_nothing_left()
