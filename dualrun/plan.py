"""Plan: a function from (config, cluster, the shell's CUDA_VISIBLE_DEVICES) to every process, where it runs and with
which env.

No Ray, no torch: `dualrun plan` prints it and both launchers consume it. Values only known at launch
time (the master port, a server's address, the run id) appear as `<auto>` until the launcher fills them in.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping

from dualrun import protocol
from dualrun.config.model import JobConfig, RoleSpec, frozen_map
from dualrun.envspec import rank_env, redact
from dualrun.errors import ConfigError, escaped

AUTO = "<auto>"
ROUTER = "router"   # the kind of the process that puts a separate role's engine replicas behind one address


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

    @staticmethod
    def uniform(num_nodes: int, gpus_per_node: int, cpus_per_node: float = 0.0) -> "Cluster":
        addr = lambda i: "127.0.0.1" if num_nodes == 1 else f"node{i}"  # noqa: E731
        return Cluster(tuple(Node(i, addr(i), gpus_per_node, cpus_per_node) for i in range(num_nodes)))


@dataclass(frozen=True)
class Process:
    unit: str                     # placement unit: a role, or colocated roles joined by '+'
    roles: tuple[str, ...]        # roles living in this process
    kind: str                     # 'worker' runs the user's program; 'server' serves a role (one engine replica,
                                  # `rank` of `world_size`); 'router' puts a role's replicas behind one address
    rank: int
    world_size: int
    node: int
    local_rank: int
    local_world_size: int
    devices: tuple[int, ...]
    env: Mapping[str, str] = field(default_factory=frozen_map)

    @property
    def label(self) -> str:
        if self.kind == ROUTER:
            return f"{self.unit} router"
        return f"{self.unit} rank {self.rank}" if self.kind == "worker" else f"{self.unit} server {self.rank}"


@dataclass(frozen=True)
class Plan:
    backend: str
    method: str
    source: str
    cluster: Cluster
    processes: tuple[Process, ...]
    env: Mapping[str, str]
    external: Mapping[str, str] = field(default_factory=frozen_map)  # role -> address of a user-run server
    machine_rank: int | None = None    # torchrun: the node this launch is for

    @property
    def workers(self) -> tuple[Process, ...]:
        return tuple(p for p in self.processes if p.kind == "worker")

    @property
    def servers(self) -> tuple[Process, ...]:
        """What the launchers start before the trainers: every engine replica, then (after a role's replicas)
        the router in front of them."""
        return tuple(p for p in self.processes if p.kind in ("server", ROUTER))

    def on_node(self, node: int) -> tuple[Process, ...]:
        return tuple(p for p in self.processes if p.node == node)

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "method": self.method,
            "config": self.source,
            "machine_rank": self.machine_rank,
            "cluster": {"source": self.cluster.source,
                        "nodes": [{"index": n.index, "address": n.address, "gpus": n.gpus, "cpus": n.cpus}
                                  for n in self.cluster.nodes]},
            "env": redact(self.env),
            "external_servers": dict(self.external),
            "processes": [
                {"unit": p.unit, "roles": list(p.roles), "kind": p.kind, "rank": p.rank,
                 "world_size": p.world_size, "node": p.node, "local_rank": p.local_rank,
                 "devices": list(p.devices), "env": redact(p.env)}
                for p in self.processes
            ],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def table(self) -> str:
        """Per node: which GPU runs which role and rank."""
        lines = [f"plan: backend={self.backend} method={self.method} config={escaped(self.source)} "
                 f"cluster={self.cluster.source} ({len(self.cluster.nodes)} node(s))"]
        by_node: dict[int, list[Process]] = {}
        for p in self.processes:   # once, not per node: 65536 ranks on 8192 nodes stay fast
            by_node.setdefault(p.node, []).append(p)
        for node in self.cluster.nodes:
            procs = by_node.get(node.index)
            if not procs:
                continue
            mark = " (this machine)" if self.machine_rank == node.index else ""
            lines.append(f"node {node.index} {node.address}{mark}: {node.gpus} GPU(s)")
            for p in procs:
                dev = "GPU " + ",".join(map(str, p.devices)) if p.devices else "CPU"
                lines.append(f"  {dev:<12} {p.label}" + (f"  (world {p.world_size}, local_rank {p.local_rank})"
                                                          if p.kind == "worker" else ""))
        for role, addr in self.external.items():
            lines.append(f"external {role} server at {addr}")
        return "\n".join(lines)


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


def visible_devices(cfg: JobConfig, environ: Mapping[str, str] | None = None) -> tuple[int, ...] | None:
    """The launching shell's CUDA_VISIBLE_DEVICES as ids, where it decides the job's GPUs (None: it does not).

    torchrun and accelerate run a node's ranks on the GPUs the shell makes visible, and a local Ray cluster
    started for the job holds only those too; a Ray cluster that is joined has its own GPUs on its own nodes."""
    import os

    if not any(r.gpus for r in cfg.roles):
        return None
    environ = os.environ if environ is None else environ
    raw = environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    if cfg.backend == "ray" and (cfg.ray.address not in (None, "local") or environ.get("RAY_ADDRESS")
                                 or cfg.num_machines > 1):
        return None
    parts = [p.strip() for p in raw.split(",") if p.strip()]
    if parts and parts[0] == "-1":
        parts = []
    if not all(p.isdigit() and len(p) < 5 for p in parts) or len(set(parts)) != len(parts):
        raise ConfigError("<environment>", "CUDA_VISIBLE_DEVICES", "distinct GPU ids like 3,4 (dualrun plans "
                          "on ids; unset it to plan on all GPUs)", raw)
    return tuple(int(p) for p in parts)


def assumed_cluster(cfg: JobConfig, environ: Mapping[str, str] | None = None) -> Cluster:
    """The cluster a config implies when none is described: num_machines equal nodes, on the GPUs the launching
    shell makes visible (CUDA_VISIBLE_DEVICES) when it sets them."""
    n = cfg.num_machines
    primary = cfg.primary
    per_node_primary = primary.gpus // n if primary.gpus else 0
    servers = sum(r.gpus for g, r in units(cfg)[1:] if not r.address)
    visible = visible_devices(cfg, environ)
    per_machine = cfg.torchrun.gpus_per_machine if cfg.backend == "torchrun" else None
    if per_machine is not None and visible is not None and per_machine != len(visible):
        raise ConfigError(cfg.source, "torchrun.gpus_per_machine", "the launching shell's CUDA_VISIBLE_DEVICES "
                          f"count, {len(visible)} (or unset it)", per_machine)
    if visible is not None:
        for role in cfg.roles:
            outside = sorted(set(role.gpu_ids or ()) - set(visible))
            if outside:
                raise ConfigError(cfg.source, f"roles.{role.name}.gpu_ids", "ids among the launching shell's "
                                  f"CUDA_VISIBLE_DEVICES={','.join(map(str, visible))}", outside[0])
        hosts = ["127.0.0.1"] if n == 1 else [(cfg.main_process_ip or "HEAD")] + [f"node{i}" for i in range(1, n)]
        return Cluster(tuple(Node(i, hosts[i], len(visible), device_ids=visible) for i in range(n)))
    if per_machine is not None:   # every machine alike: the servers fill what the trainers leave, in order
        hosts = ["127.0.0.1"] if n == 1 else [(cfg.main_process_ip or "HEAD")] + [f"node{i}" for i in range(1, n)]
        return Cluster(tuple(Node(i, hosts[i], per_machine) for i in range(n)))
    if cfg.backend == "torchrun":
        nodes = [Node(i, "127.0.0.1" if n == 1 else (cfg.main_process_ip or "HEAD") if i == 0 else f"node{i}",
                      per_node_primary + (servers if i == 0 else 0)) for i in range(n)]
        ids = [i for r in cfg.roles for i in (r.gpu_ids or ())]
        if ids and n == 1:
            nodes[0] = replace(nodes[0], gpus=max(nodes[0].gpus, max(ids) + 1))
        return Cluster(tuple(nodes))
    total = primary.gpus + servers
    per = -(-total // n) if total else 0
    return Cluster.uniform(n, per)


def make_plan(cfg: JobConfig, cluster: Cluster | None = None, extra_env: Mapping[str, str] | None = None) -> Plan:
    """Place every process of `cfg` on `cluster` (default: the cluster the config implies)."""
    cluster = cluster or assumed_cluster(cfg)
    common = _common_env(cfg, extra_env)
    free = {n.index: list(n.device_ids or range(n.gpus)) for n in cluster.nodes}
    if cfg.backend == "torchrun" and cluster.nodes:
        # fixed ids (`gpu_ids`) are reserved up front, so no role takes them by count: separate roles never share
        fixed = {gid for r in cfg.roles for gid in (r.gpu_ids or ())}
        free[cluster.nodes[0].index] = [g for g in free[cluster.nodes[0].index] if g not in fixed]
    procs: list[Process] = []
    external: dict[str, str] = {}
    for i, (group, role) in enumerate(units(cfg)):
        unit = "+".join(group)
        if i == 0:
            procs += _place_workers(cfg, cluster, free, group, role, unit, common)
            if cfg.backend == "torchrun" and cfg.torchrun.gpus_per_machine:
                for p in procs:   # on CPU a machine's slots are processes: each trainer rank takes one
                    if not p.devices and free[p.node]:
                        free[p.node].pop(0)
            continue
        if role.address:
            for name in group:
                external[name] = role.address
            continue
        procs += _place_server(cfg, cluster, free, group, role, unit, common)
    machine_rank = cfg.machine_rank if cfg.backend == "torchrun" else None
    return Plan(cfg.backend, cfg.method, cfg.source, cluster, tuple(procs), frozen_map(common),
                frozen_map(external), machine_rank)


def _common_env(cfg: JobConfig, extra: Mapping[str, str] | None) -> dict[str, str]:
    settings = protocol.Settings(
        offload_model=cfg.offload_model, offload_optimizer=cfg.offload_optimizer, max_failures=cfg.max_failures,
        collective_timeout_s=cfg.collective_timeout_s,
        roles={r.name: protocol.RoleSettings(
            gpus=r.gpus, processes=r.processes, engine=r.engine, tensor_parallel_size=r.tensor_parallel_size,
            data_parallel_size=r.data_parallel_size, model=r.model, top_k=r.top_k, separate=cfg.is_separate(r.name))
            for r in cfg.roles})
    env = {protocol.BACKEND: cfg.backend, protocol.METHOD: cfg.method, protocol.RUN_ID: AUTO, **settings.to_env()}
    env.update(cfg.env)
    env.update(extra or {})
    return env


def _take(free: dict[int, list[int]], node: int, count: int, fixed: tuple[int, ...] | None) -> tuple[int, ...]:
    if fixed is not None:
        for gid in fixed:
            if gid in free[node]:
                free[node].remove(gid)
        return tuple(fixed)  # already reserved by make_plan (torchrun)
    got, free[node][:] = free[node][:count], free[node][count:]
    return tuple(got)


def _place_workers(cfg: JobConfig, cluster: Cluster, free: dict[int, list[int]], group: tuple[str, ...],
                   role: RoleSpec, unit: str, common: Mapping[str, str]) -> list[Process]:
    world = role.processes
    nodes = cluster.nodes
    per_process_gpu = 1 if role.gpus else 0
    if cfg.backend == "torchrun":
        n = cfg.num_machines
        if len(nodes) < n:
            raise ConfigError(cfg.source, "num_machines", f"at most {len(nodes)} machines in this cluster", n)
        per = world // n
        slots = [(nodes[i].index, per) for i in range(n)]
    else:
        slots = []
        left = world
        for node in nodes:
            if left == 0:
                break
            if per_process_gpu:
                cap = len(free[node.index])
            elif node.cpus and cfg.ray.num_cpus_per_worker:   # a live cluster: Ray packs CPU ranks per node too
                cap = int(node.cpus // cfg.ray.num_cpus_per_worker) or 0
                cap = cap if node.index != nodes[-1].index else left
            else:
                cap = left
            take = min(cap, left)
            if take:
                slots.append((node.index, take))
                left -= take
        if left:
            have = sum(len(v) for v in free.values())
            raise ConfigError(cfg.source, f"roles.{role.name}.gpus",
                              f"at most {have} GPUs (the cluster has {sum(x.gpus for x in nodes)} in "
                              f"{len(nodes)} node(s))", world)
    procs: list[Process] = []
    rank = 0
    node_ranks = {idx: r for r, (idx, _) in enumerate(slots)}
    for node_index, count in slots:
        if per_process_gpu:
            if role.gpu_ids is not None and len(slots) == 1:
                devices = _take(free, node_index, count, role.gpu_ids)
            else:
                if len(free[node_index]) < count:
                    node = nodes[node_index]
                    raise ConfigError(cfg.source, f"roles.{role.name}.gpus",
                                      f"at most {len(free[node_index])} free GPUs on node {node.index}"
                                      + _visible_note(node), count)
                devices = _take(free, node_index, count, None)
        else:
            devices = ()
        for local in range(count):
            if cfg.backend == "ray":
                mine = (devices[local],) if devices else ()
                local_rank, local_world, visible = 0, 1, mine
            else:
                mine, local_rank, local_world, visible = (devices[local],) if devices else (), local, count, devices
            env = rank_env(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
                           node_rank=node_ranks[node_index], num_nodes=len(slots),
                           master_addr=AUTO if cfg.backend == "ray" else (cfg.main_process_ip or "127.0.0.1"),
                           master_port=cfg.main_process_port or AUTO, max_restarts=cfg.max_failures,
                           run_id=AUTO)
            env.update(common)
            env.update(role.env)
            env.update({"NODE_RANK": str(node_ranks[node_index]),
                        "CUDA_VISIBLE_DEVICES": ",".join(map(str, visible)),
                        protocol.ROLE: unit, protocol.ROLES: ",".join(group)})
            procs.append(Process(unit, group, "worker", rank, world, node_index, local_rank, local_world, mine,
                                 frozen_map(env)))
            rank += 1
    return procs


def _place_server(cfg: JobConfig, cluster: Cluster, free: dict[int, list[int]], group: tuple[str, ...],
                  role: RoleSpec, unit: str, common: Mapping[str, str]) -> list[Process]:
    """A separate role's engines: one replica of `engine_size` GPUs each (torchrun: on the first machine, from 0
    up, with that many free GPUs left by the trainers, started by that machine's launcher; Ray: each on any node,
    in its own placement group), and with several a router (CPU only; torchrun: on machine 0, beside trainer
    rank 0; Ray: on the first replica's node) whose address the trainers get."""
    from dualrun.servers.commands import engine_size, replica_count, server_env

    count = replica_count(cfg, role)
    size = engine_size(cfg, role) if role.gpus else 0
    slots = size or (1 if cfg.backend == "torchrun" and cfg.torchrun.gpus_per_machine else 0)   # CPU: a process
    fixed = role.gpu_ids
    candidates: Iterable[Node] = cluster.nodes
    env = dict(common)
    env.update(server_env(cfg, role))
    env.update(role.env)
    env.update({protocol.ROLE: unit, protocol.ROLES: ",".join(group)})
    procs = []
    for replica in range(count):
        mine = tuple(fixed[replica * size:(replica + 1) * size]) if fixed is not None else None
        node = next((n for n in candidates if len(free[n.index]) >= slots or mine is not None), None)
        if node is None:
            have = max((len(free[n.index]) for n in candidates), default=0)
            what = "GPUs" if size else "process slots (torchrun.gpus_per_machine)"
            what = f"{slots} free {what} on one node for each of its {count} engines" if count > 1 else \
                f"at most {have} free {what} on one node for a separate role"
            raise ConfigError(cfg.source, f"roles.{role.name}.gpus",
                              (f"{what} (engine {replica} finds at most {have})" if count > 1 else what)
                              + _visible_note(next(iter(candidates), None)), role.gpus)
        taken = _take(free, node.index, slots, mine) if slots else ()
        devices = taken if size else ()
        procs.append(Process(unit, group, "server", replica, count, node.index, 0, 1, devices,
                             frozen_map({**env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, devices))})))
    if count > 1:
        home = cluster.nodes[0].index if cfg.backend == "torchrun" else procs[0].node
        procs.append(Process(unit, group, ROUTER, 0, count, home, 0, 1, (),
                             frozen_map({**env, "CUDA_VISIBLE_DEVICES": ""})))
    return procs


def _visible_note(node: Node | None) -> str:
    if node is None or not node.device_ids:
        return ""
    return f" (the launching shell's CUDA_VISIBLE_DEVICES={','.join(map(str, node.device_ids))})"
