"""`collective_timeout_s`: one key for the collective timeout, on both backends.

A rank that never joins an all-reduce makes the other fail after the configured seconds (torch's default would
wait 30 minutes); TrainingArguments' `ddp_timeout` is filled only where left at its default."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import REPO, dualrun
from ray_helpers import ray_env

HANG = """
import os, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 0:
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
        print("no timeout", flush=True)
    except Exception:
        print("timed out after %.0f s" % (time.monotonic() - t0), flush=True)
else:
    time.sleep(8)      # never joins the all-reduce
os._exit(0)
"""

FILL = """
from dualrun.rank.trainer_defaults import activate
activate()
from transformers import TrainingArguments
print(TrainingArguments(output_dir="o").ddp_timeout, TrainingArguments(output_dir="o", ddp_timeout=99).ddp_timeout)
import torch.distributed as dist
print(dist.init_process_group._dualrun_timeout)
"""


@pytest.mark.slow
def test_ddp_timeout_is_filled_only_where_left_at_default(tmp_path):
    env = dict(os.environ, DUALRUN_SETTINGS='{"collective_timeout_s": 42}', PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", FILL], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["42", "99", "42.0"]
    assert "ddp_timeout=42" in proc.stderr


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(200)
@pytest.mark.parametrize("backend", ["torchrun", "ray"])
def test_a_hung_all_reduce_fails_after_the_configured_seconds(tmp_path, backend, ray_cluster_if_ray):
    address = ray_cluster_if_ray.address if ray_cluster_if_ray else ""
    (tmp_path / "hang.py").write_text(HANG)
    (tmp_path / "cpu2.yaml").write_text("use_cpu: true\nroles: {train: {gpus: 2}}\ncollective_timeout_s: 2\n")
    proc = dualrun("launch", "--backend", backend, "--config_file", "cpu2.yaml", "hang.py", cwd=tmp_path,
                   env=ray_env(RAY_ADDRESS=address), timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if "timed out after" in ln or "no timeout" in ln)
    seconds = float(line.rsplit(" ", 2)[-2])
    assert 1 <= seconds <= 6, line   # without the key: 8 s, when rank 1 leaves
