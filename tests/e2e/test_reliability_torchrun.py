"""torchrun backend under stress: signals stop everything, concurrent jobs never collide."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from helpers import pids_matching

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180), pytest.mark.slow]

SLEEPER = """
import os, sys, time, pathlib
import torch.distributed as dist
dist.init_process_group("gloo")
pathlib.Path(sys.argv[1], f"up{dist.get_rank()}").write_text(str(os.getpid()))
time.sleep(300)
"""

QUICK = """
import os, sys, pathlib, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
pathlib.Path(sys.argv[1], f"done{dist.get_rank()}").write_text(str(t.item()))
dist.destroy_process_group()
"""


def _wait_for(paths, timeout=90):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(p.exists() for p in paths):
            return
        time.sleep(0.2)
    raise AssertionError(f"not all of {paths} appeared")


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_stops_every_worker(tmp_path, sig, code):
    marker = f"sleeper_{uuid.uuid4().hex[:8]}.py"
    (tmp_path / marker).write_text(SLEEPER)
    (tmp_path / "c.yaml").write_text("use_cpu: true\nroles: {train: {gpus: 2}}\n")
    proc = subprocess.Popen([sys.executable, "-m", "dualrun", "launch", "--config_file", "c.yaml", marker,
                             str(tmp_path)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for([tmp_path / "up0", tmp_path / "up1"])
        assert len(pids_matching(marker)) >= 2
        proc.send_signal(sig)
        start = time.monotonic()
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == code, err
        while pids_matching(marker) and time.monotonic() - start < 10:
            time.sleep(0.2)
        assert pids_matching(marker) == [], "workers left behind"
        assert time.monotonic() - start < 10
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in pids_matching(marker):
            os.kill(pid, signal.SIGKILL)


def test_three_jobs_at_once_do_not_collide(tmp_path):
    (tmp_path / "quick.py").write_text(QUICK)
    (tmp_path / "c.yaml").write_text("use_cpu: true\nroles: {train: {gpus: 2}}\n")
    for attempt in range(2):
        outs = []
        for j in range(3):
            out = tmp_path / f"a{attempt}j{j}"
            out.mkdir()
            outs.append(out)
        procs = [subprocess.Popen([sys.executable, "-m", "dualrun", "launch", "--config_file", "c.yaml", "quick.py",
                                   str(o)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for o in outs]
        results = [p.communicate(timeout=150) for p in procs]
        assert [p.returncode for p in procs] == [0, 0, 0], [r[1][-2000:] for r in results]
        for o in outs:
            assert (o / "done0").read_text() == (o / "done1").read_text() == "2.0"
