"""The shape of a separate role's engines as the plan places them: the devices one engine takes, how many engines
(replicas) a role runs, whether they take the trainer's weights, and the env each needs.

Why apart from the command lines (dualrun/methods/commands.py): the plan places the replicas from these facts,
and the plan is pure, below everything that starts a process. What an engine is lives in its record
(dualrun/config/engine_kinds.py); which roles take the weights is the method's (`MethodPlugin.weight_roles`),
passed in. Pure functions of the config.
"""
from __future__ import annotations

from typing import Collection

from dualrun.config.engine_kinds import engine_of, takes_weights
from dualrun.config.fleet import planned_count
from dualrun.config.model import JobConfig, RoleSpec


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
