"""Ray's placement policy: one actor per rank holding one GPU, packed onto the live (or assumed) cluster's nodes,
each engine replica on any node with room (dualrun/plan/placement.py's `Placement`, which the plan asks)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from dualrun.config.model import JobConfig, RoleSpec
from dualrun.contract.errors import ConfigError
from dualrun.plan.placement import (AUTO, Cluster, Free, RankView, all_free, on_visible, server_gpus,
                                    visible_devices)


@dataclass(frozen=True)
class RayPlacement:
    """Ray: one actor per rank holding one GPU (LOCAL_RANK 0, its own GPU visible), packed onto the cluster's
    nodes in order; a joined cluster owns its GPUs, so the shell's CUDA_VISIBLE_DEVICES counts only for a
    cluster started for the job; each engine replica on any node with room, the router beside the first."""

    cfg: JobConfig

    @property
    def master_addr(self) -> str:
        return AUTO   # the node of rank 0's actor, known once it is placed

    @property
    def processes_take_slots(self) -> bool:
        return False

    @property
    def spares_unplaced(self) -> bool:
        """Nodes join while the job runs: a spare with no room now waits in a pending placement group
        (fleet_follow.py) and starts on the node Ray places it on."""
        return True

    def assumed_cluster(self, environ: Mapping[str, str]) -> Cluster:
        """An embedded cluster on the GPUs the shell makes visible when it sets them; otherwise (and for a
        cluster that is joined) num_machines equal nodes holding what the roles ask for."""
        cfg = self.cfg
        joined = cfg.ray.address not in (None, "local") or environ.get("RAY_ADDRESS") or cfg.num_machines > 1
        visible = None if joined else visible_devices(cfg, environ)
        if visible is not None:
            return on_visible(cfg, visible)
        total = cfg.primary.gpus + server_gpus(cfg)
        return Cluster.uniform(cfg.num_machines, -(-total // cfg.num_machines) if total else 0)

    def free_devices(self, cluster: Cluster) -> Free:
        return all_free(cluster)

    def worker_slots(self, cluster: Cluster, free: Free, role: RoleSpec) -> list[tuple[int, int]]:
        """Pack the ranks node by node: as many as a node has free GPUs (CPU ranks: as its CPUs hold
        `ray.num_cpus_per_worker`, on a live cluster; a node without CPUs holds none), the rest on the next. With
        `ray.placement_strategy` SPREAD (or STRICT_SPREAD) one rank per node with room in turn, as Ray spreads them."""
        nodes = cluster.nodes
        caps = []
        for node in nodes:
            if role.gpus:
                cap = len(free[node.index])
            elif cluster.live and self.cfg.ray.num_cpus_per_worker:   # a live cluster: Ray packs CPU
                cap = int(node.cpus // self.cfg.ray.num_cpus_per_worker)            # ranks too
                cap = cap if node.index != nodes[-1].index else role.processes
            else:
                cap = role.processes
            caps.append(cap)
        counts = [0] * len(nodes)
        left = role.processes
        if self.cfg.ray.placement_strategy in ("SPREAD", "STRICT_SPREAD"):
            while left and any(c < cap for c, cap in zip(counts, caps)):
                for i, cap in enumerate(caps):
                    if left and counts[i] < cap:
                        counts[i] += 1
                        left -= 1
        else:
            for i, cap in enumerate(caps):
                counts[i] = min(cap, left)
                left -= counts[i]
        if left:
            have = sum(len(v) for v in free.values())
            raise ConfigError(self.cfg.source, f"roles.{role.name}.gpus",
                              f"at most {have} GPUs (the cluster has {sum(x.gpus for x in nodes)} in "
                              f"{len(nodes)} node(s))", role.processes)
        return [(node.index, n) for node, n in zip(nodes, counts) if n]

    def rank_view(self, local: int, count: int, devices: tuple[int, ...]) -> RankView:
        mine = (devices[local],) if devices else ()
        return RankView(mine, 0, 1, mine)

    def router_node(self, cluster: Cluster, replicas: Sequence[int]) -> int:
        return replicas[0]

    @property
    def server_log_dir(self) -> str | None:
        return self.cfg.log_dir
    def cpu_server_node(self, cluster: Cluster, used: Mapping[int, float]) -> int | None:
        """A live cluster: the node with the most CPUs left (Ray gives a one-bundle placement group the node with the
        most of what it asks free), where one is left; a planned cluster's CPUs are unknown (None)."""
        if not cluster.live:
            return None
        need = max(self.cfg.ray.num_cpus_per_worker, 1.0)
        left = {n.index: n.cpus - used.get(n.index, 0.0) for n in cluster.nodes}
        room = [n.index for n in cluster.nodes if left[n.index] >= need]
        return max(room, key=lambda i: left[i]) if room else None

    def cpus(self, kind: str, devices: Sequence[int]) -> float:
        """The CPUs a process's bundle asks for (backends/ray/bundles.py, `bundle_of`)."""
        per = self.cfg.ray.num_cpus_per_worker
        if kind == "server":
            return 0.0 if devices else max(per, 1.0)
        return per
