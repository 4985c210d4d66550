"""The trainer's weight-sync group as a job forms it: who joins, where, at which address (pure, but for reading
this host's address on its route out).

Why: TRL's trainer pushes its weights to the rollout engines over one torch.distributed group (NCCL on GPUs, gloo
on CPU) - rank 0 the trainer (the rendezvous master: a TCPStore on trainer rank 0's node, at the address vLLM's
`get_ip()` gives and the job's `vllm_group_port`), then each engine replica's workers from its rank offset on.
Across nodes this group is the commonest place a job hangs (a firewalled port, a wrong interface), and only after
every model has loaded: `dualrun check` forms the same group first (`rehearsal.py`), from this description.

Standard library only: the Ray tasks of the check import it without torch.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Mapping

from dualrun.plan.meeting import Rendezvous
from dualrun.config.model import JobConfig
from dualrun.plan.processes import Plan
from dualrun.plan.engines import engine_size
from dualrun.programs.routing import rank_offsets

# The variables that decide which interface and address the group uses (torch's gloo and NCCL, vLLM's get_ip).
NET_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "VLLM_HOST_IP", "HOST_IP")


@dataclass(frozen=True)
class Member:
    """One process of the group as the job runs it: the trainer's rank 0, or one engine replica (its workers)."""

    label: str
    node: int
    ranks: tuple[int, ...]
    env: Mapping[str, str] = field(default_factory=dict)   # its interface variables (NET_VARS) in the job

    @property
    def name(self) -> str:
        if self.ranks == (0,):
            return self.label
        if len(self.ranks) == 1:
            return f"{self.label} (rank {self.ranks[0]})"
        return f"{self.label} (ranks {self.ranks[0]}-{self.ranks[-1]})"


@dataclass(frozen=True)
class SyncGroup:
    """The trainer's weight-sync group: `members[0]` is trainer rank 0, the master; NCCL when the engines have
    GPUs (and trainer rank 0's node has CUDA: the master decides, as TRL's trainer does from its device)."""

    members: tuple[Member, ...]
    world_size: int
    gpus: bool
    role: str = ""   # the role whose engines take the weights (its model's files size the check's estimate)

    @property
    def master(self) -> Member:
        return self.members[0]


def sync_group(cfg: JobConfig, plan: Plan) -> SyncGroup | None:
    """Pure: the group the job would form on `plan`, or None where it has none: the replicas the plan marks as
    taking the trainer's weights (`Serving.takes_weights`: a role the method names in its `weight_roles`, on an
    engine that can take them, started by dualrun; a server you run yourself is not placed)."""
    replicas = [p for p in plan.servers if p.kind == "server" and p.serving is not None and p.serving.takes_weights
                and p.placed]   # a spare planned unplaced (Ray) has no node to check yet
    rank0 = next((p for p in plan.workers if p.rank == 0), None)
    if rank0 is None or not replicas:
        return None
    replicas = [p for p in replicas if p.unit == replicas[0].unit]   # TRL's trainers push to one role's engines
    role = cfg.role(replicas[0].roles[0])
    assert role is not None
    size = engine_size(cfg, role)
    offsets = rank_offsets([size] * len(replicas), 1)
    gpus = role.gpus > 0
    # torchrun: the plan's devices are the process's own; on Ray the member's task is given its GPUs by Ray
    own_devices = gpus and cfg.backend_kind.per_machine
    members = [Member("trainer rank 0", rank0.node, (0,), net_env(rank0.env, own_devices))]
    members += [Member(f"{role.name} server {p.rank}", p.node, tuple(range(first, first + size)),
                       net_env(p.env, own_devices)) for p, first in zip(replicas, offsets)]
    return SyncGroup(tuple(members), 1 + size * len(replicas), gpus, role.name)


def net_env(env: Mapping[str, str], devices: bool = False) -> dict[str, str]:
    """The variables of a process's env the group depends on: its interface ones, and its GPUs where asked."""
    return {k: v for k, v in env.items() if k in NET_VARS or (devices and k == "CUDA_VISIBLE_DEVICES")}


def port_host(rdzv: Rendezvous) -> str:
    """Where the job picks its free weight-sync port on trainer rank 0's node: loopback for one torchrun machine,
    every address otherwise (the Ray rank 0 actor picks on all of them too)."""
    return "127.0.0.1" if rdzv.per_machine and rdzv.num_machines == 1 else "0.0.0.0"


def advertised_address(env: Mapping[str, str] | None = None) -> str:
    """The address trainer rank 0 gives the engines as `master_address`: TRL passes vLLM's `get_ip()`, which is
    VLLM_HOST_IP when set, else this host's address on its route out (no packet is sent), else 0.0.0.0 (vLLM warns;
    only this machine can then reach it). HOST_IP is not read: vLLM ignores it (it warns that it is deprecated)."""
    env = os.environ if env is None else env
    if env.get("VLLM_HOST_IP"):
        return env["VLLM_HOST_IP"]
    for family, peer in ((socket.AF_INET, "8.8.8.8"), (socket.AF_INET6, "2001:4860:4860::8888")):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((peer, 80))
                return s.getsockname()[0]
        except OSError:
            continue
    return "0.0.0.0"


def node_host_env(env: Mapping[str, str], node_address: str | None) -> dict[str, str]:
    """Pure: what a trainer on a node of a job across several nodes adds to `env` so that, as trainer rank 0, it
    advertises its node's address to the engines (`node_address`: the one the other nodes reach it at, its Ray
    address): VLLM_HOST_IP, which vLLM's `get_ip()` returns. Without it `get_ip()` gives the address on this host's
    route out: another interface's where the default route is not the cluster's network (the engines dial an
    address they cannot reach and wait out the group's timeout), 0.0.0.0 where there is none (each dials
    itself). Nothing on one node (no `node_address`) or where the user chose the address (VLLM_HOST_IP)."""
    if not node_address or env.get("VLLM_HOST_IP"):
        return {}
    return {"VLLM_HOST_IP": node_address}


def group_host_env(weight_sync: bool, env: Mapping[str, str], one_host: bool) -> dict[str, str]:
    """The trainers' weight-sync address where every process of the job is on this host: `node_host_env` with
    127.0.0.1, so the group's store on trainer rank 0 listens on loopback alone (wire.tcp_store) and the engines
    reach it there; otherwise that store answers anyone on the network. Only for a job whose trainers push their
    weights to a separate role's engines (`Plan.weight_sync`)."""
    return node_host_env(env, "127.0.0.1" if one_host and weight_sync else None)
