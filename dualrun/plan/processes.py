"""Plan: a function from (config, cluster, the shell's CUDA_VISIBLE_DEVICES) to every process, where it runs and with
which env.

No Ray, no torch, no environment of its own: `dualrun plan` prints it and both launchers consume it; where the
launching shell's variables count (CUDA_VISIBLE_DEVICES, RAY_ADDRESS), the caller passes them in. What differs
between the backends is the placement policy's (dualrun/plan/placement.py). Values only known at launch time (the
master port, a server's address, the run id) appear as `<auto>` until the launcher fills them in.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping

from dualrun.contract import protocol
from dualrun.config.model import JobConfig, RoleSpec, frozen_map
from dualrun.config.engine_kinds import WeightRoles, weight_roles_of
from dualrun.config.fleet import FleetBounds, bounds
from dualrun.plan.engines import engine_size, mark_cpu_engines, role_takes_weights, server_env
from dualrun.env.worker import rank_env
from dualrun.contract.redact import redact
from dualrun.contract.errors import ConfigError, escaped
from dualrun.plan.placement import (AUTO, UNPLACED, Cluster, Free, Node, Placement, placement_for, spares_unplaced,
                                    units)
from dualrun.plan.meeting import Rendezvous, rendezvous_of
from dualrun.plan.optional import machine_of_fleet, optional_machines, refuse_placement
from dualrun.plan.server_commands import ServerMethod, with_method
from dualrun.plan.servers import ROUTER, Serving

__all__ = ["AUTO", "ROUTER", "UNPLACED", "Cluster", "Node", "Plan", "Process", "make_plan", "units"]



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
    serving: Serving | None = None   # a server's command, health, timeouts, restarts, log (plan/servers.py)
    wants: int = 0   # a spare planned unplaced (node UNPLACED): the GPUs it takes where it starts

    @property
    def placed(self) -> bool:
        """On a node of the plan (not a spare left for the cluster to place where room appears)."""
        return self.node != UNPLACED

    @property
    def gpus(self) -> int:
        """The GPUs it holds: its devices, or (unplaced) those its node will give it."""
        return len(self.devices) or self.wants

    @property
    def label(self) -> str:
        if self.kind == ROUTER:
            return f"{self.unit} router"
        return f"{self.unit} rank {self.rank}" if self.kind == "worker" else f"{self.unit} server {self.rank}"


def spare_start(plan: "Plan") -> str:
    """When a placed spare starts: by a resize, or (a fleet that follows the cluster) also once it has room."""
    return ("when the cluster has room for it, or by `dualrun scale`" if plan.spares_follow_room
            else "by `dualrun scale`")


@dataclass(frozen=True)
class Plan:
    backend: str
    method: str
    source: str
    cluster: Cluster
    processes: tuple[Process, ...]
    env: Mapping[str, str]
    external: Mapping[str, str] = field(default_factory=frozen_map)  # role -> address of a user-run server
    slot: str = "GPU"                  # what a node's count counts: GPUs, or process slots on a CPU plan
    rendezvous: Rendezvous | None = None   # how the processes meet (plan/meeting.py): all a launcher reads
    fleets: Mapping[str, FleetBounds] = field(default_factory=frozen_map)   # unit -> its replicas' bounds
    # the separate roles (started here or at `address`) the method pushes the trainer's weights to (its
    # `weight_roles`): the trainers open a weight-sync group with them
    weight_roles: frozenset[str] = frozenset()
    # the placement's `spares_unplaced`: nodes join while the job runs and its fleets follow them (Ray), so a spare
    # starts when the cluster has room for it, not only by `dualrun scale`
    spares_follow_room: bool = False
    # the method's wiring of the servers' addresses into the trainers' env (role -> host:port => env), given a
    # method: the launchers call it once the servers run
    wiring: Callable[[Mapping[str, str]], Mapping[str, str]] | None = field(default=None, compare=False,
                                                                             repr=False)

    @property
    def machine_rank(self) -> int | None:
        """The machine this launch is for (a backend launched on every machine by hand: the rendezvous's), None
        where one launch places every node. One source: the rendezvous."""
        r = self.rendezvous
        return r.machine_rank if r is not None and r.per_machine else None

    @property
    def weight_sync(self) -> bool:
        """Whether the trainers push their weights to a separate role's servers (a weight-sync port for them)."""
        return bool(self.weight_roles)

    def wiring_env(self, addresses: Mapping[str, str]) -> dict[str, str]:
        """The trainers' env for the servers at `addresses` (role -> host:port): the method's wiring."""
        return dict(self.wiring(addresses)) if self.wiring is not None and addresses else {}

    @property
    def workers(self) -> tuple[Process, ...]:
        return tuple(p for p in self.processes if p.kind == "worker")

    @property
    def servers(self) -> tuple[Process, ...]:
        """What the launchers start for the separate roles (beside the trainers): every engine replica, then
        (after a role's replicas) the router in front of them."""
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
            "fleets": {unit: {"start": b.start, "min": b.low, "max": b.high} for unit, b in self.fleets.items()},
            "processes": [
                {"unit": p.unit, "roles": list(p.roles), "kind": p.kind, "rank": p.rank,
                 "world_size": p.world_size, "node": p.node if p.placed else None, "local_rank": p.local_rank,
                 "devices": list(p.devices), "env": redact(p.env),
                 **({"spare": True} if p.serving is not None and p.serving.spare else {})}
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
        optional = optional_machines(self)
        for p in self.processes:   # once, not per node: 65536 ranks on 8192 nodes stay fast
            by_node.setdefault(p.node, []).append(p)
        for node in self.cluster.nodes:
            procs = by_node.get(node.index)
            if not procs:
                continue
            mark = " (this machine)" if self.machine_rank == node.index else ""
            lines.append(f"node {node.index} {node.address}{mark}: {node.gpus} {self.slot}(s)")
            if not any(p.kind == "worker" for p in procs):
                lines.append("  no ranks: this machine runs only the servers below"
                             + ("; optional: the job starts without it, and it may join later, stop (SIGTERM) "
                                "or be lost" if node.index in optional else ""))
            for p in procs:
                dev = "GPU " + ",".join(map(str, p.devices)) if p.devices else "CPU"
                spare = p.serving is not None and p.serving.spare and p.node not in optional
                lines.append(f"  {dev:<12} {p.label}" + (f"  (world {p.world_size}, local_rank {p.local_rank})"
                                                          if p.kind == "worker" else "")
                             + (f"  (spare: started {spare_start(self)})" if spare else ""))
        unplaced = [p for p in self.processes if not p.placed]
        if unplaced:
            lines.append("unplaced: no node above has room for these")
        for p in unplaced:
            lines.append(f"  {f'{p.gpus} {self.slot}(s)':<12} {p.label}  (a spare, placed when a node with room joins)")
        for role, addr in self.external.items():
            lines.append(f"external {role} server at {addr}")
        for unit, b in self.fleets.items():
            if b.resizable:
                how = "its optional machines come and go" if unit in machine_of_fleet(self) else \
                    f"`dualrun scale {unit} N` while it runs"
                lines.append(f"fleet {unit}: {b.shown()} replicas ({how})")
        return "\n".join(lines)


def make_plan(cfg: JobConfig, cluster: Cluster | None = None, method: "ServerMethod | WeightRoles | None" = None,
              extra_env: Mapping[str, str] | None = None, environ: Mapping[str, str] | None = None) -> Plan:
    """Place every process of `cfg` on `cluster` (default: the cluster the config implies, on the GPUs the
    launching shell's `environ` makes visible; pass os.environ where the shell counts, None: it sets nothing),
    with the rendezvous. `method`: the method's plugin: its `weight_roles` take the trainer's weights (None: no
    role takes them), and a plugin that builds server commands gives every server's command and health path and
    the trainers' wiring too: the whole of what a launcher runs."""
    plan = _placed(cfg, cluster, extra_env, environ, method)
    if not isinstance(method, ServerMethod):   # a method's weight roles alone (`dualrun check` places with them)
        return plan
    return replace(with_method(plan, cfg, method), wiring=functools.partial(method.wiring_env, cfg))


def _placed(cfg: JobConfig, cluster: Cluster | None, extra_env: Mapping[str, str] | None,
            environ: Mapping[str, str] | None, method: WeightRoles | None) -> Plan:
    policy = placement_for(cfg)
    cluster = cluster or policy.assumed_cluster({} if environ is None else environ)
    weight_roles = weight_roles_of(method)
    common = _common_env(cfg, extra_env, weight_roles)
    free = policy.free_devices(cluster)
    procs: list[Process] = []
    external: dict[str, str] = {}
    fleets: dict[str, FleetBounds] = {}
    for i, (group, role) in enumerate(units(cfg)):
        unit = "+".join(group)
        if i == 0:
            procs += _place_workers(cfg, policy, cluster, free, group, role, unit, common)
            if policy.processes_take_slots:
                for p in procs:   # on CPU a machine's slots are processes: each trainer rank takes one
                    if not p.devices and free[p.node]:
                        free[p.node].pop(0)
            continue
        if role.address:
            for name in group:
                external[name] = role.address
            continue
        procs += _place_server(cfg, policy, cluster, free, group, role, unit, common, weight_roles,
                               _cpus_used(policy, procs))
        fleets[unit] = bounds(cfg, role)
    _every_machine_runs(cfg, cluster, procs)
    slot = "process slot" if cfg.use_cpu and policy.processes_take_slots else "GPU"   # a CPU plan's slots
    plan = Plan(cfg.backend, cfg.method, cfg.source, cluster, tuple(mark_cpu_engines(cfg, procs)),
                frozen_map(common), frozen_map(external), slot, rendezvous_of(cfg),
                frozen_map(fleets), _pushed_to(cfg, weight_roles), spares_unplaced(policy))
    refuse_placement(cfg, plan, fleets)   # several torchrun machines: a fleet moves by optional machines
    return plan


def _pushed_to(cfg: JobConfig, weight_roles: frozenset[str]) -> frozenset[str]:
    """The separate roles (started here or at `address`) the method pushes the trainer's weights to: TRL's client
    opens its weight-sync group with their servers, so the trainers get a port of the job's own for it (an engine
    that cannot take weights is refused for a trainer that syncs: methods' `check_program`)."""
    return frozenset(r.name for r in cfg.roles if cfg.is_separate(r.name) and r.name in weight_roles)


def _every_machine_runs(cfg: JobConfig, cluster: Cluster, procs: list[Process]) -> None:
    """torchrun with the trainers on some machines only: each other machine must run servers (its launcher would
    have nothing to run, and machine 0 would wait for it)."""
    if not cfg.backend_kind.per_machine or cfg.trainer_machines == tuple(range(cfg.num_machines)):
        return
    busy = {p.node for p in procs}
    idle = [n.index for n in cluster.nodes if n.index not in busy]
    if idle:
        primary = cfg.primary
        key = next(f"roles.{r.name}.machines" for r in [primary, *cfg.roles]
                   if r.name in cfg.group_of(primary.name) and r.machines is not None)
        raise ConfigError(cfg.source, key, f"every machine of the job running ranks or servers (machine {idle[0]} "
                          "gets neither: list it here, or give a separate role `machines` that holds it)",
                          list(cfg.trainer_machines))


def _common_env(cfg: JobConfig, extra: Mapping[str, str] | None, weight_roles: frozenset[str]) -> dict[str, str]:
    settings = protocol.Settings(
        offload_model=cfg.offload_model, offload_optimizer=cfg.offload_optimizer, max_failures=cfg.max_failures,
        collective_timeout_s=cfg.collective_timeout_s,
        roles={r.name: protocol.RoleSettings(
            gpus=r.gpus, processes=r.processes, engine=r.engine, tensor_parallel_size=r.tensor_parallel_size,
            data_parallel_size=r.data_parallel_size, model=r.model, top_k=r.top_k, separate=cfg.is_separate(r.name))
            for r in cfg.roles})
    env = {protocol.BACKEND: cfg.backend, protocol.METHOD: cfg.method, protocol.RUN_ID: AUTO, **settings.to_env()}
    if any(cfg.is_separate(r.name) and not r.address and role_takes_weights(cfg, r, weight_roles) for r in cfg.roles):
        env[protocol.WEIGHT_SYNC_TIMEOUT_S] = f"{cfg.weight_sync_timeout_s:g}"   # both ends of the weight sync
    env.update(cfg.env)
    env.update(extra or {})
    return env


def _take(free: Free, node: int, count: int, fixed: tuple[int, ...] | None) -> tuple[int, ...]:
    if fixed is not None:
        for gid in fixed:
            if gid in free[node]:
                free[node].remove(gid)
        return tuple(fixed)  # torchrun: held back from `free` by its policy already
    got, free[node][:] = free[node][:count], free[node][count:]
    return tuple(got)


def _place_workers(cfg: JobConfig, policy: Placement, cluster: Cluster, free: Free, group: tuple[str, ...],
                   role: RoleSpec, unit: str, common: Mapping[str, str]) -> list[Process]:
    world = role.processes
    slots = policy.worker_slots(cluster, free, role)
    procs: list[Process] = []
    rank = 0
    node_ranks = {idx: r for r, (idx, _) in enumerate(slots)}
    for node_index, count in slots:
        if role.gpus:   # one GPU per rank
            if role.gpu_ids is not None and len(slots) == 1:
                devices = _take(free, node_index, count, role.gpu_ids)
            else:
                if len(free[node_index]) < count:
                    node = cluster.nodes[node_index]
                    raise ConfigError(cfg.source, f"roles.{role.name}.gpus",
                                      f"at most {len(free[node_index])} free GPUs on node {node.index}"
                                      + _visible_note(node), count)
                devices = _take(free, node_index, count, None)
        else:
            devices = ()
        for local in range(count):
            view = policy.rank_view(local, count, devices)
            env = rank_env(rank=rank, world_size=world, local_rank=view.local_rank,
                           local_world_size=view.local_world_size, node_rank=node_ranks[node_index],
                           num_nodes=len(slots), master_addr=policy.master_addr,
                           master_port=cfg.main_process_port or AUTO, max_restarts=cfg.max_failures, run_id=AUTO)
            env.update(common)
            env.update(role.env)
            env.update({"NODE_RANK": str(node_ranks[node_index]),
                        "CUDA_VISIBLE_DEVICES": ",".join(map(str, view.visible)),
                        protocol.ROLE: unit, protocol.ROLES: ",".join(group)})
            procs.append(Process(unit, group, "worker", rank, world, node_index, view.local_rank,
                                 view.local_world_size, view.devices, frozen_map(env)))
            rank += 1
    return procs


def _cpus_used(policy: Placement, procs: Iterable[Process]) -> dict[int, float]:
    """CPUs per node that the processes placed so far take, where the policy counts them (Ray)."""
    used: dict[int, float] = {}
    for p in procs:
        if p.placed:
            used[p.node] = used.get(p.node, 0.0) + policy.cpus(p.kind, p.devices)
    return used


def _place_server(cfg: JobConfig, policy: Placement, cluster: Cluster, free: Free, group: tuple[str, ...],
                  role: RoleSpec, unit: str, common: Mapping[str, str], weight_roles: frozenset[str],
                  used: dict[int, float] | None = None) -> list[Process]:
    """A separate role's engines: one replica of `engine_size` GPUs each, each on the first node with that many
    free GPUs left by the trainers (fixed `gpu_ids`: those), and with several a router (CPU only) on the node
    the placement policy says, whose address the trainers get."""
    fleet = bounds(cfg, role)
    count, total = fleet.start, fleet.high   # replicas started at launch; and the spares `dualrun scale` starts
    size = engine_size(cfg, role) if role.gpus else 0
    slots = size or (1 if policy.processes_take_slots else 0)   # CPU: a process
    fixed = role.gpu_ids
    candidates: Iterable[Node] = _candidates(cluster, role)
    env = dict(common)
    env.update(server_env(cfg, role, weight_roles))
    env.update(role.env)
    env.update({protocol.ROLE: unit, protocol.ROLES: ",".join(group)})
    first = cfg.role(group[0]) or role   # whose settings the unit's servers use
    serving = Serving(first.health_timeout_s, first.request_timeout_s,
                      restarts=first.replica_restarts if total > 1 else 0,
                      takes_weights=role_takes_weights(cfg, first, weight_roles), log_dir=policy.server_log_dir)
    procs = []
    for replica in range(total):
        mine = tuple(fixed[replica * size:(replica + 1) * size]) if fixed is not None else None
        roomy = policy.cpu_server_node(cluster, used or {}) if not size and not slots else None
        node = next((n for n in candidates if (n.index == roomy if roomy is not None else
                                               len(free[n.index]) >= slots or mine is not None)), None)
        if roomy is not None and used is not None:
            used[roomy] = used.get(roomy, 0.0) + policy.cpus("server", ())
        if node is None:
            have = max((len(free[n.index]) for n in candidates), default=0)
            what = "GPUs" if size else "process slots (torchrun.gpus_per_machine)"
            if replica >= count and spares_unplaced(policy):   # Ray: placed where room appears (fleet_follow.py)
                procs.append(Process(unit, group, "server", replica, total, UNPLACED, 0, 1, (),
                                     frozen_map({**env, "CUDA_VISIBLE_DEVICES": AUTO}),
                                     replace(serving, log_name=f"{unit}-server-{replica}.log", spare=True), size))
                continue
            if replica >= count:   # a spare: placed at launch like the others, started by `dualrun scale`
                raise ConfigError(cfg.source, f"roles.{role.name}.max_replicas", f"room for each replica up to it: "
                                  f"{slots} free {what} on one node for each (spare replica {replica} finds at "
                                  f"most {have})" + _visible_note(next(iter(candidates), None)), total)
            what = f"{slots} free {what} on one node for each of its {count} engines" if count > 1 else \
                f"at most {have} free {what} on one node for a separate role"
            raise ConfigError(cfg.source, f"roles.{role.name}.gpus",
                              (f"{what} (engine {replica} finds at most {have})" if count > 1 else what)
                              + _visible_note(next(iter(candidates), None)), role.gpus or role.processes)
        taken = _take(free, node.index, slots, mine) if slots else ()
        devices = taken if size else ()
        procs.append(Process(unit, group, "server", replica, total, node.index, 0, 1, devices,
                             frozen_map({**env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, devices))}),
                             replace(serving, log_name=f"{unit}-server-{replica}.log", spare=replica >= count)))
    if total > 1:
        home = policy.router_node(cluster, [p.node for p in procs])
        procs.append(Process(unit, group, ROUTER, 0, total, home, 0, 1, (),
                             frozen_map({**env, "CUDA_VISIBLE_DEVICES": ""}),
                             replace(serving, restarts=0, takes_weights=False, log_name=f"{unit}-router.log")))
    return procs


def _candidates(cluster: Cluster, role: RoleSpec) -> list[Node]:
    """The nodes a separate role's replicas may take, in the order they are tried: the role's `machines` where
    set (torchrun's machine ranks are the node indexes), else every node."""
    if role.machines is None:
        return list(cluster.nodes)
    by_index = {n.index: n for n in cluster.nodes}
    return [by_index[m] for m in role.machines if m in by_index]


def _visible_note(node: Node | None) -> str:
    if node is None or not node.device_ids:
        return ""
    return f" (the launching shell's CUDA_VISIBLE_DEVICES={','.join(map(str, node.device_ids))})"
