"""Placement: the cluster a plan places onto, and the few decisions in which the two backends differ.

Why one policy per backend behind one interface: torchrun runs a machine's ranks on that machine's devices,
every machine alike, while Ray packs one actor per GPU on whatever nodes the cluster has. The plan
(dualrun/plan/processes.py) asks `placement_for(cfg)` these decisions and does the rest the same way for both.

Pure: the launching shell's environment (CUDA_VISIBLE_DEVICES, RAY_ADDRESS) comes in as a mapping from the caller.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Protocol, Sequence

from dualrun.config.model import JobConfig, RoleSpec
from dualrun.contract.errors import ConfigError

AUTO = "<auto>"   # a value only known at launch time (the master port, a server's address, the run id)
UNPLACED = -1     # the node of a spare planned without room (`Placement.spares_unplaced`): known where it starts


@dataclass(frozen=True)
class Node:
    index: int
    address: str
    gpus: int
    cpus: float = 0.0
    node_id: str = ""
    device_ids: tuple[int, ...] = ()   # the node's GPU ids when not 0..gpus-1 (the shell's CUDA_VISIBLE_DEVICES)


@dataclass(frozen=True)
class Cluster:
    """What the plan places onto. `source`: 'planned' (assumed from the config) or 'ray' (read live)."""

    nodes: tuple[Node, ...]
    source: str = "planned"

    @property
    def live(self) -> bool:
        """Read from a running cluster (its nodes' real sizes), not assumed from the config."""
        return self.source != "planned"
    def addresses(self) -> int:
        """How many distinct node addresses: more than one, the nodes are machines of their own (several Ray nodes
        on one host share its address)."""
        return len({n.address for n in self.nodes})

    @staticmethod
    def uniform(num_nodes: int, gpus_per_node: int, cpus_per_node: float = 0.0) -> "Cluster":
        addr = lambda i: "127.0.0.1" if num_nodes == 1 else f"node{i}"  # noqa: E731
        return Cluster(tuple(Node(i, addr(i), gpus_per_node, cpus_per_node) for i in range(num_nodes)))


Free = dict[int, list[int]]   # node index -> the GPU ids not yet taken, in the order they are handed out


@dataclass(frozen=True)
class RankView:
    """One rank as it sees its node: its own GPU, LOCAL_RANK / LOCAL_WORLD_SIZE and its CUDA_VISIBLE_DEVICES."""

    devices: tuple[int, ...]
    local_rank: int
    local_world_size: int
    visible: tuple[int, ...]


class Placement(Protocol):
    """What the plan asks of a backend."""

    @property
    def master_addr(self) -> str:
        """MASTER_ADDR of the trainers as planned (AUTO: the launcher fills it in)."""

    @property
    def processes_take_slots(self) -> bool:
        """Whether on CPU a machine's slots (`torchrun.gpus_per_machine`) are processes, one per rank or engine."""

    @property
    def spares_unplaced(self) -> bool:
        """Whether a fleet's spare replica that finds no room when the plan is made is planned unplaced (its node
        and devices given by the cluster when room appears while the job runs) instead of refused (a backend whose
        machines are fixed when the job starts). The trainers and the replicas started at launch always need room."""

    def assumed_cluster(self, environ: Mapping[str, str]) -> Cluster:
        """The cluster the config implies when none is described, given the launching shell's environment."""

    def free_devices(self, cluster: Cluster) -> Free:
        """The GPU ids roles take by count, per node (fixed `gpu_ids` may be held back)."""

    def worker_slots(self, cluster: Cluster, free: Free, role: RoleSpec) -> list[tuple[int, int]]:
        """(node index, ranks there) for the trainers of `role`, the primary role."""

    def rank_view(self, local: int, count: int, devices: tuple[int, ...]) -> RankView:
        """The `local`-th of `count` ranks on a node that gives them `devices`."""

    def router_node(self, cluster: Cluster, replicas: Sequence[int]) -> int:
        """The node of a role's router, given the nodes of its engine replicas."""

    @property
    def server_log_dir(self) -> str | None:
        """Where the servers' logs go (None: the backend decides at launch)."""
    def cpu_server_node(self, cluster: Cluster, used: Mapping[int, float]) -> int | None:
        """The node of a CPU-only engine replica given the CPUs the processes placed so far take per node (`used`);
        None: the first node with room by the plan's own rule."""

    def cpus(self, kind: str, devices: Sequence[int]) -> float:
        """The CPUs a process of `kind` on `devices` takes from its node, where the policy counts them (else 0)."""


def placement_for(cfg: JobConfig) -> Placement:
    """The placement policy of the job's backend."""
    return cfg.backend_kind.placement(cfg)


def spares_unplaced(policy: Placement) -> bool:
    """The policy's `spares_unplaced`, False where it has none: a backend's policy written before the member came
    keeps its machines fixed (a spare without room is refused in one line, as on torchrun), not an AttributeError."""
    return bool(getattr(policy, "spares_unplaced", False))


def visible_devices(cfg: JobConfig, environ: Mapping[str, str]) -> tuple[int, ...] | None:
    """The shell's CUDA_VISIBLE_DEVICES (in `environ`) as ids, for a job with GPUs; None where it is unset.

    Why they count: torchrun and accelerate run a node's ranks on the GPUs the shell makes visible, and a local
    Ray cluster started for the job holds only those too (a joined cluster has its own: the Ray policy asks)."""
    if not any(r.gpus for r in cfg.roles):
        return None
    raw = environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    parts = [p.strip() for p in raw.split(",") if p.strip()]
    if parts and parts[0] == "-1":
        parts = []
    if not all(p.isdigit() and len(p) < 5 for p in parts) or len(set(parts)) != len(parts):
        raise ConfigError("<environment>", "CUDA_VISIBLE_DEVICES", "distinct GPU ids like 3,4 (dualrun plans "
                          "on ids; unset it to plan on all GPUs)", raw)
    return tuple(int(p) for p in parts)


def _hosts(cfg: JobConfig) -> list[str]:
    n = cfg.num_machines
    return ["127.0.0.1"] if n == 1 else [(cfg.main_process_ip or "HEAD")] + [f"node{i}" for i in range(1, n)]


def on_visible(cfg: JobConfig, visible: tuple[int, ...]) -> Cluster:
    """num_machines nodes, each with the ids the shell makes visible (every machine alike)."""
    for role in cfg.roles:
        outside = sorted(set(role.gpu_ids or ()) - set(visible))
        if outside:
            raise ConfigError(cfg.source, f"roles.{role.name}.gpu_ids", "ids among the launching shell's "
                              f"CUDA_VISIBLE_DEVICES={','.join(map(str, visible))}", outside[0])
    hosts = _hosts(cfg)
    return Cluster(tuple(Node(i, hosts[i], len(visible), device_ids=visible) for i in range(cfg.num_machines)))


def units(cfg: JobConfig) -> list[tuple[tuple[str, ...], RoleSpec]]:
    """Placement units, primary first: each colocate group once, every other role alone."""
    out: list[tuple[tuple[str, ...], RoleSpec]] = []
    seen: set[str] = set()
    for role in cfg.roles:
        if role.name in seen:
            continue
        group = cfg.group_of(role.name)
        seen.update(group)
        out.append((group, role))
    return out


def server_gpus(cfg: JobConfig) -> int:
    """GPUs of the separate roles dualrun starts servers for (a user-run `address:` takes none here)."""
    return sum(r.gpus for _, r in units(cfg)[1:] if not r.address)


def server_gpus_by_machine(cfg: JobConfig) -> dict[int, int]:
    """GPUs of the separate roles dualrun starts servers for, on the machine that holds them when the machines'
    sizes are not given: the first of a role's `machines`, else machine 0."""
    out: dict[int, int] = {}
    for _, r in units(cfg)[1:]:
        if not r.address:
            home = r.machines[0] if r.machines else 0
            out[home] = out.get(home, 0) + r.gpus
    return out


def all_free(cluster: Cluster) -> Free:
    return {n.index: list(n.device_ids or range(n.gpus)) for n in cluster.nodes}


@dataclass(frozen=True)
class MachinesPlacement:
    """torchrun: one launch per machine (the config's num_machines), a machine's ranks on the devices of that
    machine (LOCAL_RANK indexes them), the same count on every machine that runs ranks (all, unless the trainers'
    `machines` names some: the others only serve); separate roles' engines on the GPUs the trainers leave,
    machine 0's first; fixed `gpu_ids` are machine 0's and held back from every role placed by count."""

    cfg: JobConfig

    @property
    def master_addr(self) -> str:
        return self.cfg.main_process_ip or "127.0.0.1"

    @property
    def processes_take_slots(self) -> bool:
        return bool(self.cfg.torchrun.gpus_per_machine)

    @property
    def spares_unplaced(self) -> bool:
        return False   # the machines are fixed: a spare sits on one of them (several: an optional one)

    def assumed_cluster(self, environ: Mapping[str, str]) -> Cluster:
        """On the GPUs the shell makes visible when it sets them, else `torchrun.gpus_per_machine` on every
        machine, else just what the roles ask for: the trainers' share on each machine, the servers on machine 0."""
        cfg = self.cfg
        n = cfg.num_machines
        visible = visible_devices(cfg, environ)
        per_machine = cfg.torchrun.gpus_per_machine
        if per_machine is not None and visible is not None and per_machine != len(visible):
            raise ConfigError(cfg.source, "torchrun.gpus_per_machine", "the launching shell's "
                              f"CUDA_VISIBLE_DEVICES count, {len(visible)} (or unset it)", per_machine)
        if visible is not None:
            return on_visible(cfg, visible)
        hosts = _hosts(cfg)
        if per_machine is not None:   # every machine alike: the servers fill what the trainers leave, in order
            return Cluster(tuple(Node(i, hosts[i], per_machine) for i in range(n)))
        primary = cfg.primary
        with_ranks = cfg.trainer_machines
        per_node_primary = primary.gpus // len(with_ranks) if primary.gpus else 0
        servers = server_gpus_by_machine(cfg)
        nodes = [Node(i, hosts[i], (per_node_primary if i in with_ranks else 0) + servers.get(i, 0))
                 for i in range(n)]
        ids = [i for r in cfg.roles for i in (r.gpu_ids or ())]
        if ids and n == 1:
            nodes[0] = replace(nodes[0], gpus=max(nodes[0].gpus, max(ids) + 1))
        return Cluster(tuple(nodes))

    def free_devices(self, cluster: Cluster) -> Free:
        free = all_free(cluster)
        if cluster.nodes:   # fixed ids are reserved up front, so no role takes them by count: roles never share
            fixed = {gid for r in self.cfg.roles for gid in (r.gpu_ids or ())}
            first = cluster.nodes[0].index
            free[first] = [g for g in free[first] if g not in fixed]
        return free

    def worker_slots(self, cluster: Cluster, free: Free, role: RoleSpec) -> list[tuple[int, int]]:
        n = self.cfg.num_machines
        nodes = cluster.nodes
        if len(nodes) < n:
            raise ConfigError(self.cfg.source, "num_machines", f"at most {len(nodes)} machines in this cluster", n)
        with_ranks = self.cfg.trainer_machines   # every machine, unless the trainers' `machines` names some
        return [(nodes[i].index, role.processes // len(with_ranks)) for i in with_ranks]

    def rank_view(self, local: int, count: int, devices: tuple[int, ...]) -> RankView:
        return RankView((devices[local],) if devices else (), local, count, devices)

    def router_node(self, cluster: Cluster, replicas: Sequence[int]) -> int:
        return cluster.nodes[0].index   # machine 0's launcher starts it, beside trainer rank 0

    @property
    def server_log_dir(self) -> str | None:
        return self.cfg.torchrun.log_dir or self.cfg.log_dir   # beside torchrun's own logs of the ranks
    def cpu_server_node(self, cluster: Cluster, used: Mapping[int, float]) -> int | None:
        return None

    def cpus(self, kind: str, devices: Sequence[int]) -> float:
        return 0.0
