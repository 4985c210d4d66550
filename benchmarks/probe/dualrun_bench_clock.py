"""When this process started, on `time.time()`'s clock: the one reading the benchmark probe (sitecustomize.py) and
the growth benchmark's rank scripts (empty_rank.py, pg_rank.py) share. Standard library only: it is imported
before anything else a rank loads, and its cost is part of what the benchmarks time."""
from __future__ import annotations

import os


def process_start() -> float | None:
    """This process's start time from /proc (10 ms resolution); None where /proc cannot say."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            btime = next(int(ln.split()[1]) for ln in f if ln.startswith("btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration):
        return None
