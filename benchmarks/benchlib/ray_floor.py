"""Ray's own floor for starting a job: `import ray`, `ray.init()` of a fresh local cluster, one actor answering a
call, `ray.shutdown()`. What any launcher on an embedded Ray cluster pays before a rank can start
(startup_bench.py measures dualrun's embedded start-up against it, in the same session).

    python benchmarks/benchlib/ray_floor.py [--lean]     # writes DIR/floor-PID.json (DIR from DUALRUN_BENCH_PHASES)

Without `--lean`: `ray.init()` as is (Ray's defaults: dashboard, log monitor, autoscaler monitor, metrics).
`--lean`: the very node dualrun's embedded cluster starts (dualrun.backends.ray.connect: no dashboard, no log or
autoscaler monitor, no metrics export, bound to 127.0.0.1; docs/concepts.md "Ray's idle cost"), so that the
difference to a dualrun launch is dualrun's own work alone. Times are `time.time()` (the clock of the benchmark's
spawn time and of the probe's records).
"""
from __future__ import annotations

import json
import os
import sys
import time

probe = time.time()
lean = "--lean" in sys.argv[1:]

import ray  # noqa: E402 - timed

imported = time.time()
if lean:
    import logging

    from dualrun.backends.ray.connect import lean_node

    with lean_node() as settings:   # as dualrun's embedded start (connect()) does it
        ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
                 log_to_driver=False, logging_level=logging.WARNING, **settings)
else:
    ray.init()
initialised = time.time()


@ray.remote(num_cpus=0.001)
class Actor:
    def pid(self) -> int:
        return os.getpid()


ray.get(Actor.remote().pid.remote())
actor = time.time()
ray.shutdown()
down = time.time()
folder = os.environ.get("DUALRUN_BENCH_PHASES")
if folder:
    with open(os.path.join(folder, f"floor-{os.getpid()}.json"), "w") as f:
        json.dump({"probe": probe, "ray_imported": imported, "ray_init": initialised, "actor_ready": actor,
                   "ray_shutdown": down}, f)
