"""One child process in a process group of its own: started, signalled as a group, stopped SIGTERM -> grace -> SIGKILL.

Why one class: a server (servers/process.py) and a Ray rank's program (backends/ray/actors/rank_actor.py) both start a
command that may start helpers of its own (vLLM's engine core, a dataloader's workers); stopping the whole group
is what leaves nothing behind, and the two must stop alike. Standard library only: Ray worker processes and
server actors import it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
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
        wait_group_gone(self.proc.pid, KILL_WAIT_S)   # vLLM's engine processes outlived the leader by up to a second
        return self.proc.returncode


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of the process group `pgid`, from /proc; [] when there are none."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return []
    members = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2:].split()   # state, ppid, pgrp, ...
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b"Z":
            members.append(int(entry))
    return members


def wait_group_gone(pgid: int, timeout_s: float) -> bool:
    """Wait until every process of the group has exited (SIGKILL is delivered at once, but a big process takes a
    while to release its memory): a stop returns only when nothing it started is left. False on timeout."""
    deadline = time.monotonic() + timeout_s
    while group_members(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True
