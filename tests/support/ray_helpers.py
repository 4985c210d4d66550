"""Helpers for the Ray backend tests: a fake-GPU multi-node cluster on loopback, and leftover counters.

Every cluster a test starts lives in its own short temp dir (Ray's unix sockets need short paths, and its
`ray_current_cluster` file must not leak into other jobs); tests stop what they start and never `ray stop`.
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from typing import Any


class FakeGpuCluster:
    """`ray.cluster_utils.Cluster` with `nodes` nodes of `gpus` fake GPUs; this process is connected as a driver
    so tests can count actors and placement groups."""

    def __init__(self, nodes: int = 2, gpus: int = 2, cpus: int = 2, node_tmpdirs: list[str] | None = None) -> None:
        """`node_tmpdirs`: each node's TMPDIR (its raylet and so its workers see it), as on separate machines."""
        import ray
        from ray.cluster_utils import Cluster

        self.temp_dir = tempfile.mkdtemp(prefix="drt", dir="/tmp")
        os.makedirs(os.path.join(self.temp_dir, "ray"), exist_ok=True)
        from helpers import free_port

        # Lean, as dualrun's embedded cluster (backends/ray/connect.py): no log monitor (dualrun never logs to the
        # driver), no autoscaler monitor, no metrics export or task events, no usage stats, the dashboard agent's
        # scan every 60 s. A test run keeps up to three such clusters idle beside its jobs on 2 cores. Ray's worker
        # niceness stays Ray's (15), as on a cluster a user started.
        from dualrun.backends.ray.connect import LEAN_ENV, LEAN_NODE_PARAMS, LEAN_SYSTEM_CONFIG

        # the dashboard agent's port: Ray's default (52365) is one per host, and the run's shared cluster lives
        # beside clusters that tests start with `ray start` (whose agent then cannot bind it: no job agent)
        args = dict(num_cpus=cpus, num_gpus=gpus, node_ip_address="127.0.0.1", include_dashboard=False,
                    temp_dir=self.temp_dir, dashboard_agent_listen_port=free_port(), **LEAN_NODE_PARAMS)
        system_config = {k: v for k, v in LEAN_SYSTEM_CONFIG.items() if k != "worker_niceness"}
        # Ray's `ray_current_cluster` file goes to $RAY_TMPDIR/ray: this cluster's own dir, never /tmp/ray
        lock = _one_start_at_a_time()   # before the env changes below: a failure here leaves the env as it was
        saved = {k: os.environ.get(k) for k in ("RAY_TMPDIR", "TMPDIR", *LEAN_ENV)}
        os.environ["RAY_TMPDIR"] = self.temp_dir
        for key, value in LEAN_ENV.items():
            os.environ.setdefault(key, value)
        try:
            for i in range(nodes):
                if node_tmpdirs:
                    os.environ["TMPDIR"] = node_tmpdirs[i]
                if i == 0:
                    self.cluster = Cluster(initialize_head=True,
                                           head_node_args=dict(args, _system_config=system_config))
                else:
                    self.cluster.add_node(**args)
            self.cluster.wait_for_nodes()
        finally:
            lock.close()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self.address = self.cluster.address
        self.connect()

    def connect(self) -> None:
        """Make this process a driver of this cluster. One process is a driver of one cluster at a time, and the
        run-wide cluster (conftest's `ray_cluster`) lives beside a module's own: the counters reconnect."""
        import ray

        if ray.is_initialized():
            if ray.get_runtime_context().gcs_address == self.address:
                return
            ray.shutdown()
        ray.init(address=self.address, log_to_driver=False)

    def alive_actors(self) -> list[dict[str, Any]]:
        import ray

        self.connect()
        return [a for a in ray._private.state.actors().values() if a.get("State") != "DEAD"]

    def live_placement_groups(self) -> list[dict[str, Any]]:
        import ray

        self.connect()
        return [p for p in ray.util.placement_group_table().values() if p.get("state") != "REMOVED"]

    def assert_nothing_left(self, timeout: float = 30.0) -> None:
        """No actor and no placement group left on this (running, shared) cluster once a job has ended."""
        from helpers import eventually

        assert eventually(lambda: not self.alive_actors(), timeout=timeout), self.alive_actors()
        assert eventually(lambda: not self.live_placement_groups(), timeout=timeout), self.live_placement_groups()

    def shutdown(self) -> None:
        import ray

        if ray.is_initialized() and ray.get_runtime_context().gcs_address == self.address:
            ray.shutdown()
        self.cluster.shutdown()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _one_start_at_a_time():
    """An exclusive lock (released on close) that every test worker takes while its clusters start: each xdist
    worker has its own running cluster (conftest.ray_cluster), and two starting at once on 2 busy cores can miss
    Ray's start-up timeouts."""
    import fcntl

    f = open(os.path.join(tempfile.gettempdir(), "dualrun-test-ray-start.lock"), "a")
    fcntl.flock(f, fcntl.LOCK_EX)
    return f


def ray_env(**extra: str) -> dict[str, str]:
    """Env for a `dualrun` subprocess: no inherited RAY_ADDRESS, a private Ray temp dir (RAY_TMPDIR, short for
    Ray's socket paths; removed when the test session ends)."""
    tmp = tempfile.mkdtemp(prefix="drt", dir="/tmp")
    atexit.register(shutil.rmtree, tmp, True)
    env = {"RAY_ADDRESS": "", "RAY_TMPDIR": tmp}
    env.update(extra)
    return env


DUMP_ENV = """
import json, os, sys
with open(os.path.join(sys.argv[1], "env_%s.json" % os.environ["RANK"]), "w") as f:
    json.dump(dict(os.environ), f, sort_keys=True)
"""

GLOO = """
import json, os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print("rank", dist.get_rank(), "sum", t.item(), "cwd", os.getcwd(), flush=True)
print("to stderr from", dist.get_rank(), file=sys.stderr, flush=True)
dist.destroy_process_group()
"""

CRASH = """
import os, sys, time
print("started", os.environ["RANK"], flush=True)
if os.environ["RANK"] == "1":
    time.sleep(1.0)   # let rank 0 get going: the failure must stop a running rank
    raise ValueError("rank one is broken")
time.sleep(120)
"""

SLEEP = """
import os, sys, time
print("ready", os.environ["RANK"], flush=True)
time.sleep(120)
"""

KILL_ACTOR = """
import os, signal, time
print("ready", os.environ["RANK"], flush=True)
if os.environ["RANK"] == "1":
    time.sleep(0.5)
    os.kill(os.getppid(), signal.SIGKILL)   # the rank's Ray actor dies under it
time.sleep(120)
"""

FAIL_FIRST_ATTEMPT = """
import os, sys
print("attempt", os.environ["TORCHELASTIC_RESTART_COUNT"], flush=True)
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
    sys.exit(7)
"""
