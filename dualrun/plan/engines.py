"""The shape of a separate role's engines as the plan places them: the devices one engine takes, how many engines
(replicas) a role runs, whether they take the trainer's weights, and the env each needs.

Why apart from the command lines (dualrun/methods/commands.py): the plan places the replicas from these facts,
and the plan is pure, below everything that starts a process. What an engine is lives in its record
(dualrun/config/engine_kinds.py); which roles take the weights is the method's (`MethodPlugin.weight_roles`),
passed in. Pure functions of the config.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Collection, TypeVar

from dualrun.contract import protocol
from dualrun.config.engine_kinds import engine_of, takes_weights
from dualrun.config.fleet import planned_count
from dualrun.config.model import JobConfig, RoleSpec, frozen_map

P = TypeVar("P", bound=Any)   # the plan's Process (plan/processes.py), which imports this module


def role_takes_weights(cfg: JobConfig, role: RoleSpec | None, weight_roles: Collection[str]) -> bool:
    """Whether the engines of `role` receive the trainer's weights (a restarted replica of one is held out of
    rotation until its first weight update: dualrun/servers/supervision.py)."""
    return takes_weights(cfg, role, weight_roles)


def server_env(cfg: JobConfig, role: RoleSpec, weight_roles: Collection[str]) -> dict[str, str]:
    """Env a role's server needs beyond the job's: its engine's for a server that takes the weights (vLLM's dev
    mode, as `trl vllm-serve` sets: TRL's client endpoints live behind it)."""
    if not role.address and takes_weights(cfg, role, weight_roles):
        return dict(engine_of(cfg, role).weight_env)
    return {}


def engine_size(cfg: JobConfig, role: RoleSpec) -> int:
    """Devices (GPUs, or CPU processes where the role has no GPUs) one engine of the role takes."""
    return engine_of(cfg, role).size(role)


def replica_count(cfg: JobConfig, role: RoleSpec) -> int:
    """Engines a separate role runs: its GPUs (or CPU processes) over one engine's size. More than one stand
    behind one address, the router's (`dualrun.programs.router`): TRL's trainers take a single server address."""
    return planned_count(cfg, role)


def mark_cpu_engines(cfg: JobConfig, procs: list[P]) -> list[P]:
    """CPU engines whose record asks it (`EngineKind.quiet_on_cpu`: vLLM's CPU build): each marked to wait instead
    of spin (dualrun/servers/quiet_readers.py), and where a machine has several, each with its share of the
    machine's cores ('j/k'), which it binds its OpenMP threads to where it starts (dualrun/servers/cpu_share.py);
    vLLM alone binds them all to the same cores."""
    if not cfg.use_cpu:
        return procs
    on_node: dict[int, list[int]] = {}
    for i, p in enumerate(procs):
        role = cfg.role(p.roles[0])
        if p.kind == "server" and role is not None and engine_of(cfg, role).quiet_on_cpu:
            on_node.setdefault(p.node, []).append(i)
    out = list(procs)
    for engines in on_node.values():
        for j, i in enumerate(engines):
            share = {protocol.CPU_SHARE: f"{j}/{len(engines)}"} if len(engines) > 1 else {}
            out[i] = replace(out[i], env=frozen_map({**out[i].env, protocol.QUIET_READERS: "1", **share}))
    return out
