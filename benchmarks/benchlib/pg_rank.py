"""The growth benchmark's tiniest training function, the same under every launcher: import torch, join the gloo
process group (unless the launcher already did: Ray Train's TorchTrainer sets it up before its loop), one
all_reduce (the first step), then leave.

Writes DIR/rank-R.json (DIR from DUALRUN_BENCH_PHASES): its process start time (/proc), when the script started,
when torch was imported, when the group was joined and when the all_reduce returned (`ran`), all time.time().
"""
import json
import os
import sys
import time

script = time.time()
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "probe"))
from dualrun_bench_clock import process_start  # noqa: E402 - after the first timestamp

started = process_start()

import torch  # noqa: E402 - timed
import torch.distributed as dist  # noqa: E402

imported = time.time()
ours = not dist.is_initialized()
if ours:
    dist.init_process_group("gloo")
joined = time.time()
total = torch.ones(1)
dist.all_reduce(total)
ran = time.time()
folder = os.environ.get("DUALRUN_BENCH_PHASES")
if folder:
    with open(os.path.join(folder, f"rank-{dist.get_rank()}.json"), "w") as f:
        json.dump({"rank": dist.get_rank(), "started": started, "script": script, "torch": imported,
                   "joined": joined, "ran": ran, "world": int(total.item())}, f)
if ours:
    dist.destroy_process_group()
