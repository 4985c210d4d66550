"""The SLURM backend inside an allocation made with `salloc` (the launch in the foreground, as at a terminal), and
`--submit` with a `slurm:` section, on a real one-node SLURM cluster (tests/support/slurm_helpers.py), started only
in the loopback-only namespace, skipped with the reason where SLURM is not installed (CI)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import dualrun, link_tiny, pids_matching, pids_under

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
NO_SLURM = {k: "" for k in os.environ if k.startswith("SLURM_")}
SLEEPS = """
import os, sys, time
open(os.path.join(sys.argv[1], "rank" + os.environ["RANK"]), "w").close()
time.sleep(600)
"""


@pytest.fixture(scope="module")
def slurm():
    from slurm_helpers import one_node_slurm

    with one_node_slurm("drsa") as cluster:
        yield cluster


def _env(slurm) -> dict[str, str]:
    outside = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return {**outside, "SLURM_CONF": slurm.env["SLURM_CONF"]}


def _salloc(slurm, cwd: Path, *command: str, **popen) -> subprocess.Popen:
    """`salloc --nodes=1 --ntasks=2 COMMAND` from `cwd` in a process group of its own, as a terminal's foreground
    job is (its Ctrl-C goes to the whole group)."""
    return subprocess.Popen(["salloc", "--nodes=1", "--ntasks=2", *command], cwd=cwd, env=_env(slurm),
                            start_new_session=True, **popen)



class Terminal:
    """A pseudo-terminal the command runs on as a terminal's foreground job does: a session of its own with the
    terminal as its controlling one (salloc hands the foreground process group to its command, as at a shell), and
    Ctrl-C typed on it (the terminal driver's SIGINT to that foreground group). What it writes is kept."""

    def __init__(self, argv: list[str], cwd: Path, env: dict[str, str]) -> None:
        import fcntl
        import pty
        import termios
        import threading

        self.master, slave = pty.openpty()

        def controlling() -> None:   # after setsid: this terminal becomes the session's controlling one
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=slave, stdout=slave, stderr=slave,
                                     start_new_session=True, preexec_fn=controlling)
        os.close(slave)
        self.chunks: list[bytes] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:
                return
            if not data:
                return
            self.chunks.append(data)

    @property
    def text(self) -> str:
        return b"".join(self.chunks).decode(errors="replace")

    def ctrl_c(self) -> None:
        os.write(self.master, b"\x03")

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.reader.join(timeout=5)
        os.close(self.master)


@pytest.mark.timeout(400)
def test_ctrl_c_in_salloc_ends_the_job_within_seconds_and_leaves_no_process(slurm, tiny, tmp_path):
    """GKD with a teacher server: `salloc dualrun launch ...` at a terminal, the ranks' step and the teacher's step
    running, Ctrl-C typed: the launch (salloc's foreground job) stops every step and ends within seconds, interrupted
    (130), salloc gives the allocation back, and no rank, no server, no srun and no task shim is left."""
    link_tiny(tiny, tmp_path)
    engine = str(tmp_path / "tiny" / "teacher")
    (tmp_path / "c.yaml").write_text("use_cpu: true\nmethod: gkd\nroles:\n  train: {gpus: 2}\n"
                                     f"  teacher: {{gpus: 1, model: {engine}, engine: transformers, top_k: 5, "
                                     "health_timeout_s: 120}\n")
    (tmp_path / "w.py").write_text(SLEEPS)
    term = Terminal(["salloc", "--nodes=1", "--ntasks=2", sys.executable, "-m", "dualrun", "launch", "--backend",
                     "slurm", "--config_file", "c.yaml", "w.py", str(tmp_path)], tmp_path, _env(slurm))
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and term.proc.poll() is None and not (
                (tmp_path / "rank1").exists() and "server healthy" in term.text):
            time.sleep(0.5)
        assert (tmp_path / "rank1").exists() and pids_matching(engine, "cpu_engine"), term.text[-3000:] + slurm.logs()
        start = time.monotonic()
        term.ctrl_c()
        term.proc.wait(timeout=90)
        took = time.monotonic() - start
    finally:
        term.close()
    text = term.text
    assert took < 45 and term.proc.returncode == 130, (took, term.proc.returncode, text[-3000:])
    assert "stopped by SIGINT" in text and "failed" not in text.split("stopped by SIGINT")[-1], text[-3000:]
    assert not pids_under(tmp_path, "dualrun.backends.slurm.task") and not pids_matching(engine), "a task outlived Ctrl-C"
    assert not pids_matching(str(tmp_path / "w.py")) and not pids_under(tmp_path, "srun") and \
        not pids_under(tmp_path, "-m dualrun launch"), "a rank, srun or the launcher outlived it"
    jobs = subprocess.run(["squeue", "-h", "-o", "%i %j"], env=_env(slurm), capture_output=True, text=True).stdout
    assert not jobs.strip(), f"the allocation outlived it: {jobs}"


@pytest.mark.timeout(200)
def test_inside_salloc_an_unset_num_machines_is_the_allocations_node_count(slurm, tmp_path):
    """`dualrun plan` inside the allocation plans its node(s), named; a larger num_machines is refused before
    anything starts, one line, exit 2."""
    (tmp_path / "c.yaml").write_text("use_cpu: true\nroles: {train: {gpus: 2}}\n")
    (tmp_path / "two.yaml").write_text("use_cpu: true\nnum_machines: 2\nroles: {train: {gpus: 2}}\n")
    (tmp_path / "w.py").write_text("open('ran', 'w').close()\n")
    plan = _salloc(slurm, tmp_path, sys.executable, "-m", "dualrun", "plan", "--backend", "slurm", "--config_file",
                   "c.yaml", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = plan.communicate(timeout=120)
    assert plan.returncode == 0, err
    assert re.search(r"# num_machines unset: the 1 node\(s\) of SLURM job \d+", out), out
    assert "--nodelist=localhost" in out and "<node 0>" not in out, out
    two = _salloc(slurm, tmp_path, sys.executable, "-m", "dualrun", "launch", "--backend", "slurm", "--config_file",
                  "two.yaml", "w.py", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = two.communicate(timeout=120)
    line = [ln for ln in err.splitlines() if ln.startswith("dualrun:")]
    assert two.returncode == 2 and len(line) == 1 and "num_machines is 2 but SLURM job" in line[0], err
    assert not (tmp_path / "ran").exists()


@pytest.mark.timeout(300)
def test_submit_writes_the_slurm_sections_lines_and_sbatch_takes_them(slurm, tmp_path):
    """`slurm: {time, extra}` -> the batch script's #SBATCH lines -> the job SLURM runs (its time limit and comment,
    as scontrol shows them)."""
    (tmp_path / "c.yaml").write_text("use_cpu: true\nroles: {train: {gpus: 1}}\n"
                                     "slurm: {time: '7', extra: [--comment=dualrun-section]}\n")
    (tmp_path / "w.py").write_text("print('hello from the job', flush=True)\n")
    r = dualrun("launch", "--backend", "slurm", "--submit", "--config_file", "c.yaml", "w.py", cwd=tmp_path,
                env={**NO_SLURM, "SLURM_CONF": slurm.env["SLURM_CONF"]}, timeout=240)
    assert r.returncode == 0 and "hello from the job" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:] + slurm.logs()
    script = next(tmp_path.glob("dualrun-slurm-*.sbatch")).read_text()
    assert "#SBATCH --time=7\n" in script and "#SBATCH --comment=dualrun-section\n" in script, script
    job = r.stderr.split("submitted SLURM job ", 1)[1].split()[0]
    shown = subprocess.run(["scontrol", "-o", "show", "job", job], env=_env(slurm), capture_output=True,
                           text=True).stdout
    assert "TimeLimit=00:07:00" in shown and "Comment=dualrun-section" in shown, shown
