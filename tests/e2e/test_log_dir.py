"""`log_dir` as documented: each rank's output also in `LOG_DIR/<role>_<rank>.log` on both backends (torchrun's own
layout beside it, the terminal unchanged), and a `log_dir` that cannot be written refused before anything starts
(exit 2, naming `log_dir`): a read-only file system, no permission, a file in the way."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from helpers import dualrun, eventually, pids_matching
from ray_helpers import ray_env

PROGRAM = """import os, sys
rank = os.environ["RANK"]
print(f"out of rank {rank}", flush=True)   # one write: torchrun prefixes each write (under -u print writes each
print(f"err of rank {rank}", file=sys.stderr, flush=True)   # argument and the separator apart)
print(f"last words of rank {rank}")          # never flushed by the program: the exit guard flushes it
"""


def _root_with_mount_namespaces() -> bool:
    return os.geteuid() == 0 and shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-m", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _root_with_mount_namespaces(), reason="a read-only mount needs root and unshare -m")
@pytest.mark.parametrize("backend", ["torchrun", "ray"])
def test_a_log_dir_on_a_read_only_file_system_is_refused_before_anything_starts(tmp_path, backend):
    readonly = tmp_path / "ro"
    readonly.mkdir()
    (tmp_path / "job.yaml").write_text("use_cpu: true\nlog_dir: ro/logs\nroles: {train: {gpus: 2}}\n")
    (tmp_path / "t.py").write_text("open('ran', 'w')\n")
    inner = (f"mount -t tmpfs -o ro tmpfs {readonly} && exec {sys.executable} -m dualrun launch --backend {backend} "
             "--config_file job.yaml t.py")   # a private mount namespace: the read-only mount is this command's only
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", "bash", "-c", inner], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, env=dict(os.environ, **ray_env()))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "dualrun: error: job.yaml: log_dir: expected a directory dualrun can write (created when missing), got "
        f"ro/logs ({readonly} is on a read-only file system)"]
    assert not (tmp_path / "ran").exists() and not proc.stdout


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere: no permission to lack")
def test_a_log_dir_without_permission_is_refused(tmp_path):
    from dualrun.config import build_config
    from dualrun.contract.errors import ConfigError

    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(ConfigError, match=rf"log_dir: expected a directory dualrun can write .*no permission to "
                                          rf"write in {locked}"):
        build_config({"log_dir": str(locked / "logs")}, "c.yaml")


def test_a_log_dir_with_a_file_in_the_way_is_refused(tmp_path):
    from dualrun.config import build_config
    from dualrun.contract.errors import ConfigError

    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match=r"log_dir: expected a directory \(created when missing\), got 'a path "
                                          r"below the file"):
        build_config({"log_dir": str(tmp_path / "f" / "logs")}, "c.yaml")


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torchrun", "ray"])
def test_each_ranks_output_is_in_log_dir_role_rank_log(tmp_path, backend, ray_cluster_if_ray):
    (tmp_path / "p.py").write_text(PROGRAM)
    (tmp_path / "job.yaml").write_text("use_cpu: true\nlog_dir: logs\nroles: {train: {gpus: 2}}\n")
    (tmp_path / "logs").mkdir()
    for rank in (0, 1):   # an earlier run's file: appended to (config reference), not replaced
        (tmp_path / "logs" / f"train_{rank}.log").write_text("an earlier run's line\n")
    address = ray_cluster_if_ray.address if ray_cluster_if_ray else ""
    proc = dualrun("launch", "--backend", backend, "--config_file", "job.yaml", "p.py", cwd=tmp_path,
                   env=ray_env(RAY_ADDRESS=address), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "also in logs/<role>_<rank>.log" in proc.stderr
    for rank in (0, 1):   # stdout and stderr, each in its order (the two streams are copied side by side)
        logged = (tmp_path / "logs" / f"train_{rank}.log").read_text().splitlines()
        assert logged[0] == "an earlier run's line", logged
        assert sorted(ln for ln in logged if "of rank" in ln) == [
            f"err of rank {rank}", f"last words of rank {rank}", f"out of rank {rank}"], logged
        assert f"out of rank {rank}" in proc.stdout + proc.stderr   # the terminal still has it
    if backend == "torchrun":   # torchrun's own layout stays beside it
        assert list((tmp_path / "logs").glob("*/attempt_0/0/stdout.log"))
    assert eventually(lambda: not pids_matching(str(tmp_path), "log_copier.py"))   # each copier ends with its rank


def test_the_file_gets_whole_lines_however_they_reach_the_pipes():
    from dualrun.rank.log_copier import Lines

    lines = Lines(limit=8)
    assert [lines.feed(b"err of"), lines.feed(b" rank 1\nout"), lines.feed(b" of rank 1\n")] == [
        b"", b"err of rank 1\n", b"out of rank 1\n"]
    assert lines.feed(b"0123456789") == b"0123456789" and lines.rest() == b""   # no newline past the limit: as is
    assert lines.feed(b"tail") == b"" and lines.rest() == b"tail"               # the end: what is left


PIECES = """import os, sys, time
from dualrun.rank import log_tee
log_tee.start({"DUALRUN_LOG_DIR": sys.argv[1], "DUALRUN_ROLE": "train", "RANK": "3"})
for fd, piece in ((2, b"err of rank"), (1, b"out of rank"), (2, b" 3\\n"), (1, b" 3\\n"), (2, b"no newline")):
    os.write(fd, piece)
    time.sleep(0.05)   # each piece read on its own
os._exit(0)            # as the exit guard ends a rank: what is in the pipes is still copied
"""


def test_a_rank_s_pieces_of_lines_reach_the_terminal_as_they_come_and_the_file_uncut(tmp_path):
    proc = subprocess.run([sys.executable, "-c", PIECES, str(tmp_path)], capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    log = tmp_path / "train_3.log"
    assert eventually(lambda: log.exists() and log.read_bytes().endswith(b"no newline"), timeout=20), \
        log.read_bytes() if log.exists() else "no log"
    assert sorted(log.read_bytes().split(b"\n")) == [b"err of rank 3", b"no newline", b"out of rank 3"]
    assert proc.stdout == b"out of rank 3\n" and proc.stderr == b"err of rank 3\nno newline"
    assert eventually(lambda: not pids_matching(str(tmp_path), "log_copier.py"))
