"""The "empty script" of the growth benchmark: a rank that only says when it ran, then exits.

Writes DIR/rank-R.json (DIR from DUALRUN_BENCH_PHASES) with its process start time (/proc) and the time the
script itself started, both from time.time(). No torch: the growth benchmark measures the launcher, not imports.
"""
import json
import os
import sys
import time

ran = time.time()
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "probe"))
from dualrun_bench_clock import process_start  # noqa: E402 - after the first timestamp

started = process_start()
folder = os.environ.get("DUALRUN_BENCH_PHASES")
if folder:
    with open(os.path.join(folder, f"rank-{os.environ.get('RANK', 'x')}.json"), "w") as f:
        json.dump({"rank": os.environ.get("RANK"), "started": started, "ran": ran}, f)
