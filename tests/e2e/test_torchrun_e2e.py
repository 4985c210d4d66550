"""Real torchrun processes on loopback: two ranks, a failing rank, two 'nodes' on one machine."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import dualrun, free_port, pids_matching

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

GLOO = """
import json, os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
out = {"env": {k: os.environ[k] for k in os.environ}, "sum": t.item(), "argv": sys.argv[1:], "cwd": os.getcwd()}
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
if "--fail" in sys.argv and os.environ["RANK"] == "1":
    raise ValueError("rank one is broken")
"""


@pytest.fixture
def job(tmp_path):
    (tmp_path / "w.py").write_text(GLOO)
    (tmp_path / "out").mkdir()
    (tmp_path / "cpu2.yaml").write_text("use_cpu: true\nroles: {train: {gpus: 2}}\nenv: {FROM_CONFIG: yes-it-is}\n")
    return tmp_path


def _ranks(out):
    return [json.loads((out / f"rank{i}.json").read_text()) for i in range(len(list(out.glob("rank*.json"))))]


@pytest.mark.slow
def test_two_ranks_train_together(job):
    proc = dualrun("launch", "--backend", "torchrun", "--config_file", "cpu2.yaml", "w.py", "out", "--x", "1",
                   "--n", "3", "--config_file", "theirs.yaml", "-m", "x", cwd=job, env={"SHOULD_NOT_LEAK": "1"})
    assert proc.returncode == 0, proc.stderr
    ranks = _ranks(job / "out")
    assert len(ranks) == 2
    for i, r in enumerate(ranks):
        env = r["env"]
        assert env["WORLD_SIZE"] == "2" and env["RANK"] == str(i) and env["LOCAL_RANK"] == str(i)
        assert r["sum"] == 3.0 and r["argv"] == ["out", "--x", "1", "--n", "3", "--config_file", "theirs.yaml", "-m", "x"] and r["cwd"] == str(job)
        assert env["FROM_CONFIG"] == "yes-it-is" and env["ACCELERATE_USE_CPU"] == "True"
        assert env["DUALRUN_BACKEND"] == "torchrun" and env["DUALRUN_ROLE"] == "train"
        assert "SHOULD_NOT_LEAK" not in env
    assert "job succeeded" in proc.stderr


@pytest.mark.slow
def test_failing_rank_is_named_and_exit_code_kept(job):
    proc = dualrun("launch", "--config_file", "cpu2.yaml", "w.py", "out", "--fail", cwd=job)
    assert proc.returncode == 1
    assert "train rank 1 failed" in proc.stderr and "ValueError: rank one is broken" in proc.stderr
    assert not pids_matching(f"dualrun.rank.bootstrap w.py {job.name}")


@pytest.mark.slow
def test_exit_code_of_script_is_the_jobs(job):
    (job / "exit3.py").write_text("import sys, os\nsys.exit(3 if os.environ['RANK'] == '0' else 0)\n")
    proc = dualrun("launch", "--config_file", "cpu2.yaml", "exit3.py", cwd=job)
    assert proc.returncode == 3, proc.stderr
    assert "train rank 0 failed (exit code 3)" in proc.stderr


@pytest.mark.slow
def test_two_nodes_on_one_machine(job):
    """The accelerate-style multi-node recipe: the same command with machine_rank 0 and 1."""
    port = str(free_port())
    cmd = [sys.executable, "-m", "dualrun", "launch", "--config_file", "cpu2.yaml", "--num_machines", "2",
           "--machine_rank", "{rank}", "--main_process_ip", "127.0.0.1", "--main_process_port", port, "w.py", "out"]
    procs = [subprocess.Popen([c.format(rank=r) for c in cmd], cwd=job, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=150) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    ranks = _ranks(job / "out")
    assert [r["env"]["RANK"] for r in ranks] == ["0", "1"]
    assert [r["env"]["GROUP_RANK"] for r in ranks] == ["0", "1"]
    assert [r["env"]["NODE_RANK"] for r in ranks] == ["0", "1"]
    assert {r["env"]["LOCAL_RANK"] for r in ranks} == {"0"}
    assert all(r["env"]["WORLD_SIZE"] == "2" and r["sum"] == 3.0 for r in ranks)
    assert all(r["env"]["MASTER_PORT"] == port for r in ranks)
