"""CPU-seconds of dualrun's embedded Ray start alone, by process: `connect()` starts the lean node, one actor
answers, then `close()`. Prints one `RESULT {json}` line. Run it with a dualrun checkout first on PYTHONPATH, inside
a loopback-only namespace and with its own RAY_TMPDIR, alternating checkouts for a before/after:

    RAY_ADDRESS= RAY_TMPDIR=$(mktemp -d) PYTHONPATH=CHECKOUT python benchmarks/benchlib/ray_start_cpu.py
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchlib.proctree import TreeSampler  # noqa: E402

KINDS = (("gcs", "gcs_server"), ("raylet", "/raylet "), ("dashboard agent", "dashboard/agent.py|DashboardAgent"),
         ("API server", "dashboard/dashboard.py|ray-dashboard"),
         ("runtime env agent", "runtime_env/agent|RuntimeEnvAgent"), ("actor/worker", "default_worker|^ray::"))


def kind(cmd: str) -> str:
    return next((k for k, pattern in KINDS if re.search(pattern, cmd)), "other")


def main() -> None:
    t0, c0 = time.monotonic(), time.process_time()
    sampler = TreeSampler(os.getpid(), period_s=0.1)
    import ray

    from dualrun.backends.ray.connect import connect
    from dualrun.config.model import RayOptions

    conn = connect(RayOptions(address="local"), "bench", num_cpus=2)

    @ray.remote(num_cpus=1)
    class Echo:
        def ping(self) -> int:
            return os.getpid()

    ray.get(Echo.remote().ping.remote(), timeout=120)
    wall = time.monotonic() - t0
    procs = sampler.stop()
    out = {"driver": round(time.process_time() - c0, 2), "wall": round(wall, 2)}   # the driver's: the sampler too
    conn.close()
    for p in procs:
        if p["pid"] != os.getpid():
            k = kind(p["cmd"])
            out[k] = round(out.get(k, 0.0) + p["cpu_s"], 2)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
