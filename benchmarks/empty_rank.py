"""The "empty script" of the growth benchmark: a rank that only says when it ran, then exits.

Writes DIR/rank-R.json (DIR from DUALRUN_BENCH_PHASES) with its process start time (/proc) and the time the
script itself started, both from time.time(). No torch: the growth benchmark measures the launcher, not imports.
"""
import json
import os
import time

ran = time.time()
try:
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat") as f:
        btime = next(int(ln.split()[1]) for ln in f if ln.startswith("btime"))
    started = btime + ticks / os.sysconf("SC_CLK_TCK")
except (OSError, ValueError, StopIteration):
    started = None
folder = os.environ.get("DUALRUN_BENCH_PHASES")
if folder:
    with open(os.path.join(folder, f"rank-{os.environ.get('RANK', 'x')}.json"), "w") as f:
        json.dump({"rank": os.environ.get("RANK"), "started": started, "ran": ran}, f)
