"""One `srun` step run by the launcher: started in its own session, its srun error lines kept (they name the
tasks that failed), stopped so that nothing of it outlives the job.

Why `scancel` after the signals: srun forwards SIGTERM to its tasks and waits for them; an srun that must be
killed (SIGKILL) leaves its step's tasks to slurmd, so the step itself is cancelled by id."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Mapping, Sequence

TERM_WAIT_S = 10.0


class Step:
    """`argv` (an srun line) with `env`; stderr passes through, srun's own error lines are kept."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], cwd: str) -> None:
        self.proc = subprocess.Popen(list(argv), env=dict(env), cwd=cwd, stderr=subprocess.PIPE, text=True,
                                     errors="replace", bufsize=1, start_new_session=True)
        self.errors: list[str] = []
        self.ended_at: float | None = None
        self._reader = threading.Thread(target=self._pump, name="dualrun-srun-stderr", daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            if line.startswith("srun: error:"):
                self.errors.append(line.rstrip("\n"))
            try:
                sys.stderr.write(line)
                sys.stderr.flush()
            except (ValueError, OSError):
                pass

    def poll(self) -> int | None:
        code = self.proc.poll()
        if code is not None and self.ended_at is None:
            self.ended_at = time.time()
        return code

    def wait_output(self) -> None:
        self._reader.join(timeout=5.0)

    def stop(self, grace_s: float = TERM_WAIT_S) -> int:
        """SIGTERM srun (it forwards it to every task), SIGKILL after `grace_s`; its exit code."""
        if self.poll() is None:
            _signal(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                _signal(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.wait_output()
        return int(self.proc.returncode)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def steps_named(job_id: str, tag: str) -> list[str]:
    """`JOB.STEP` of the job's steps whose name holds `tag` (this launch's run id)."""
    try:
        done = subprocess.run(["squeue", "-h", "-s", "-j", job_id, "-o", "%i %j"], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.split()[0] for line in done.stdout.splitlines() if len(line.split()) == 2 and tag in line.split()[1]]


def cancel_steps(job_id: str, tag: str) -> list[str]:
    """scancel every step of this launch still known to SLURM; the ones cancelled."""
    steps = steps_named(job_id, tag)
    for step in steps:
        subprocess.run(["scancel", step], capture_output=True, timeout=30)
    return steps
