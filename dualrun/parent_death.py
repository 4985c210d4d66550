"""Children that die with the process that started them (Linux `PR_SET_PDEATHSIG`, best effort elsewhere).

Why: a launcher, a Ray actor or a role group can be killed without running its `finally` (SIGKILL, `ray.kill`,
node loss); the kernel then signals the children it started, so no rank, server or worker outlives it. Standard
library only: Ray worker processes and spawned role workers import it. The signal fires when the *thread* that
started the child exits, so callers start children from a thread that lives as long as they do.
"""
from __future__ import annotations

import ctypes
import signal

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
