"""ChildProcess (dualrun/light/child_process.py): the child and every helper it started stop together; a child that
ignores SIGTERM is killed after the grace. Real processes, well under a second each."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from dualrun.light.child_process import ChildProcess


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _started(child: ChildProcess, code: str) -> int:
    """Start `python -c code` (which prints its helper's pid); the helper's pid."""
    proc = child.start([sys.executable, "-c", code], os.environ, stdout=subprocess.PIPE, text=True)
    return int(proc.stdout.readline())


HELPER = "import subprocess, sys, time; h = subprocess.Popen(['sleep', '60']); print(h.pid, flush=True); "


def test_stop_ends_the_child_and_the_helpers_of_its_group():
    child = ChildProcess()
    helper = _started(child, HELPER + "time.sleep(60)")
    assert child.alive() and not _gone(helper)
    t0 = time.monotonic()
    code = child.stop(grace_s=5.0)
    assert code == -15 and time.monotonic() - t0 < 5.0   # SIGTERM was enough: no grace spent
    deadline = time.monotonic() + 5
    while not _gone(helper) and time.monotonic() < deadline:   # reaped by init once SIGKILLed
        time.sleep(0.05)
    assert _gone(helper) and not child.alive()
    assert child.stop(1.0) == -15   # idempotent


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace():
    child = ChildProcess()
    _started(child, "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); " + HELPER + "time.sleep(60)")
    t0 = time.monotonic()
    assert child.stop(grace_s=0.5) == -9 and 0.5 <= time.monotonic() - t0 < 5.0


def test_a_child_never_started_stops_as_nothing():
    assert ChildProcess().stop(1.0) is None
