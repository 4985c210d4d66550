"""Children that die with the process that started them (Linux `PR_SET_PDEATHSIG`, best effort elsewhere).

Why: a launcher, a Ray actor or a role group can be killed without running its `finally` (SIGKILL, `ray.kill`,
node loss); the kernel then signals the children it started, so no rank, server or worker outlives it. Standard
library only: Ray worker processes and spawned role workers import it. `PR_SET_PDEATHSIG` fires when the *thread*
that started the child exits, so its callers start children from a thread that lives as long as they do; where
that cannot be promised (a role group made in any thread of the user's program), `exit_with_process` watches the
parent *process* instead.
"""
from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

POLL_S = 0.5   # where a pidfd is not available: how often the parent's pid is checked

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies (call it in the child)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    except Exception:  # noqa: BLE001 - not Linux / no libc: the launcher's own cleanup still stops it
        pass


def terminate_with_parent() -> None:
    """`preexec_fn` for servers: SIGTERM (they shut down cleanly, e.g. vLLM frees its GPU memory)."""
    die_with_parent(signal.SIGTERM)


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def exit_with_process(parent: int) -> None:
    """In a child: SIGKILL this process once process `parent` has exited - the whole process, whichever of its
    threads started the child. A daemon thread waits on a pidfd of `parent` (Linux 5.3+; else it polls
    `os.getppid()`, which changes when the child is re-parented)."""
    if os.getppid() != parent:   # gone already (or not our parent): nothing left to serve
        _kill_self()
    try:
        fd: int | None = os.pidfd_open(parent)
    except (AttributeError, OSError):
        fd = None
    if os.getppid() != parent:   # it exited before the pidfd was opened: that pid may be another process now
        _kill_self()

    def watch() -> None:
        if fd is not None:
            import select

            poller = select.poll()
            poller.register(fd, select.POLLIN)
            while not poller.poll():
                pass
        else:
            while os.getppid() == parent:
                time.sleep(POLL_S)
        _kill_self()

    threading.Thread(target=watch, name="dualrun-parent-watch", daemon=True).start()
