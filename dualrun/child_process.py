"""One child process in a process group of its own: started, signalled as a group, stopped SIGTERM -> grace -> SIGKILL.

Why one class: a server (servers/process.py) and a Ray rank's program (launchers/ray_worker.py) both start a
command that may start helpers of its own (vLLM's engine core, a dataloader's workers); stopping the whole group
is what leaves nothing behind, and the two must stop alike. Standard library only: Ray worker processes and
server actors import it.
"""
from __future__ import annotations

import os
import signal
import subprocess
from typing import Any, Callable, Mapping, Sequence

KILL_WAIT_S = 5.0   # after SIGKILL: how long to wait for the kernel to reap it


class ChildProcess:
    """A command that leads its own process group (`start_new_session`); `proc` is its Popen once started."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def start(self, argv: Sequence[str], env: Mapping[str, str], cwd: str | None = None,
              preexec_fn: Callable[[], None] | None = None, **popen: Any) -> subprocess.Popen:
        """Popen `argv` as the leader of a new session (so of a new process group); `popen`: Popen's other
        arguments (pipes, text mode)."""
        self.proc = subprocess.Popen(list(argv), env=dict(env), cwd=cwd, stdin=subprocess.DEVNULL,
                                     start_new_session=True, preexec_fn=preexec_fn, **popen)
        return self.proc

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal_group(self, sig: int) -> None:
        """Send `sig` to the child's whole group (best effort: a group already gone is no error)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)   # start_new_session: the child leads its own group
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, grace_s: float) -> int | None:
        """SIGTERM the group, SIGKILL it after `grace_s` (also the helpers of a child that already ended).
        Idempotent; the child's exit code (None: never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        self.signal_group(signal.SIGKILL)
        try:
            self.proc.wait(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            pass
        return self.proc.returncode
