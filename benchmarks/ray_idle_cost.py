"""Ray's own floor: the cores an idle local cluster's daemons and N idle actors keep busy (no job, no output).

    unshare -n bash -c 'ip link set lo up; python benchmarks/ray_idle_cost.py'      # --actors 2 --seconds 10

What `launch_bench.py`'s "launcher CPU while training" for the Ray variants is compared against: the part of
it that Ray costs before dualrun does anything (the rank actors' core workers, GCS, raylet, dashboard/API server,
log monitor). CPU seconds of this script's descendants, split by kind (benchlib.measure.process_kind), over `--seconds`.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from benchlib.cluster import RunningCluster
from benchlib.measure import descendants_cpu
from benchlib.sandbox import ensure_loopback_only


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--actors", type=int, default=2)
    p.add_argument("--seconds", type=float, default=10.0)
    ns = p.parse_args()
    ensure_loopback_only(sys.argv[1:])
    import ray

    cluster = RunningCluster(4)
    cluster.start()
    try:
        ray.init(address=cluster.address)

        @ray.remote(num_cpus=0.001)
        class Idle:
            def pid(self) -> int:
                return os.getpid()

        actors = [Idle.remote() for _ in range(ns.actors)]
        ray.get([a.pid.remote() for a in actors])
        time.sleep(3)   # let their start-up settle
        before: dict = {}
        descendants_cpu(by_kind=before)
        time.sleep(ns.seconds)
        after: dict = {}
        descendants_cpu(by_kind=after)
        cores = {k: round((after.get(k, 0.0) - before.get(k, 0.0)) / ns.seconds, 3) for k in after}
        print(f"{ns.actors} idle actors, {ns.seconds:g} s, load average {os.getloadavg()[0]:.2f}: cores {cores}")
        ray.shutdown()
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
