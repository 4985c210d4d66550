"""What users expect from a launch, on both backends: a variable set on the command line reaches the script
or is named at start-up; under Ray an 8-step progress bar stays readable (rank 0 only, collapsed) and
`log_dir` keeps every redraw."""
from __future__ import annotations

import pytest

from helpers import dualrun
from dualrun.light.progress import looks_like_bar
from ray_helpers import ray_env

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300), pytest.mark.slow]

SCRIPT = """
import os, sys, time
from tqdm import tqdm
# one string, one write: unbuffered (PYTHONUNBUFFERED), print's separate pieces reach torchrun's tee of log_dir as
# separate writes, which a loaded machine's tailer may prefix one by one ("[default0]:seen[default0]: 0 ...")
print(f"seen {os.environ['RANK']} {os.environ.get('MY_FLAG')} {os.environ.get('OTHER_FLAG')}", flush=True)
for _ in tqdm(range(8), mininterval=0, miniters=1, ncols=60):
    time.sleep(0.05)
print(f"finished {os.environ['RANK']}", flush=True)
"""


@pytest.mark.parametrize("backend", ["torchrun", "ray"])
def test_command_line_env_and_readable_progress(tmp_path, backend):
    (tmp_path / "job.py").write_text(SCRIPT)
    (tmp_path / "cpu2.yaml").write_text("use_cpu: true\nroles: {train: {gpus: 2}}\nlog_dir: logs\n")
    env = ray_env(MY_FLAG="1", OTHER_FLAG="secretvalue", DUALRUN_FORWARD_ENV="MY_FLAG")
    proc = dualrun("launch", "--backend", backend, "--config_file", "cpu2.yaml", "job.py", cwd=tmp_path, env=env,
                   timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        assert f"seen {rank} 1 None" in proc.stdout          # MY_FLAG forwarded, OTHER_FLAG not
    notice = [ln for ln in proc.stderr.splitlines() if "not forwarded to the workers" in ln]
    assert len(notice) == 1 and "OTHER_FLAG" in notice[0] and "MY_FLAG" not in notice[0], proc.stderr[-2000:]
    assert "secretvalue" not in proc.stdout + proc.stderr
    if backend != "ray":
        return
    bars = [ln for ln in proc.stderr.splitlines() if looks_like_bar(ln)]
    assert bars and all(ln.startswith("[train rank 0] ") for ln in bars), bars
    assert len(bars) <= 3 and "8/8" in bars[-1], bars           # not one line per redraw (9+ per rank)
    logged = (tmp_path / "logs" / "train_1.log").read_text().splitlines()
    assert sum(looks_like_bar(ln) for ln in logged) >= 9          # log_dir keeps every redraw of every rank
