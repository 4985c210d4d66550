"""The "running cluster" the Ray variants join, as a user's would be: started by the benchmark itself (head node
of `ray.cluster_utils.Cluster`, its own short temp dir, no dashboard) and shut down by it, its own processes only.
It never runs `ray stop`, which would stop every other Ray on the machine."""
from __future__ import annotations

import shutil
import tempfile
import time

from .measure import descendants_cpu


class RunningCluster:
    """A local single-node Ray cluster the benchmark starts and stops (its own processes, its own temp dir)."""

    def __init__(self, cpus: int = 4) -> None:
        self.cpus = cpus
        self.cluster = None
        self.temp_dir = None
        self.address = None

    def start(self) -> float:
        from ray.cluster_utils import Cluster

        t = time.monotonic()
        self.temp_dir = tempfile.mkdtemp(prefix="lbc", dir="/tmp")
        self.cluster = Cluster(initialize_head=True, head_node_args=dict(
            num_cpus=self.cpus, node_ip_address="127.0.0.1", include_dashboard=False, temp_dir=self.temp_dir))
        self.address = self.cluster.address
        return time.monotonic() - t

    def idle_cores(self, seconds: float = 5.0) -> float:
        """Cores the idle cluster's own processes (GCS, raylet, its workers: this process's descendants) keep busy:
        what Ray takes from the ranks' CPUs before any job runs."""
        a = descendants_cpu()
        time.sleep(seconds)
        return (descendants_cpu() - a) / seconds

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None

