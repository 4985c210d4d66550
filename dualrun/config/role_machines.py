"""`roles.<name>.machines`: the machines a role runs on (torchrun), read and checked.

Why its own module: the key is read where the role is read (a list of machine ranks) but can only be judged
against the job's other keys (num_machines, the backend, which roles are the trainers'). On a separate role it
places the role's servers; on the trainers (the primary role and roles colocated with it) it names the machines
that run ranks, so a machine may only serve (TRL's layout: `trl vllm-serve` on one node, training on another)."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from dualrun.config.backends import DEFAULT, kind_of
from dualrun.config.model import trainer_group
from dualrun.contract.errors import ConfigError


def parse_machines(source: str, key: str, value: Any) -> tuple[int, ...]:
    """A non-empty list of distinct machine ranks (integers >= 0)."""
    expected = "a non-empty list of distinct machine ranks like [1] (0 .. num_machines-1)"
    if not isinstance(value, list) or not value:
        raise ConfigError(source, key, expected, value)
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise ConfigError(source, key, expected, item)
    if len(set(value)) != len(value):
        raise ConfigError(source, key, expected, f"{value} (a machine written twice)")
    return tuple(value)


def check_role_machines(source: str, acc: Mapping[str, Any], values: Mapping[str, Any], roles: Sequence[Any],
                        groups: Sequence[Sequence[str]]) -> None:
    """Only on torchrun, only machines of the job; a separate role only with servers dualrun starts; the
    trainers on machine 0 (it holds torchrun's store), their ranks shared evenly, and no machine left idle."""
    placed = [r for r in roles if r.machines is not None]
    if not placed:
        return
    backend = values.get("backend", DEFAULT)
    machines = int(acc.get("num_machines") or 1)
    with_primary = trainer_group(roles, groups)
    for role in placed:
        key = f"roles.{role.name}.machines"
        if not kind_of(backend).per_machine:
            raise ConfigError(source, key, "no `machines` on the Ray backend (Ray places a role's engines on "
                              "any node with room; use `backend: torchrun`)", list(role.machines))
        outside = [m for m in role.machines if m >= machines]
        if outside:
            raise ConfigError(source, key, f"machine ranks in 0..{machines - 1} (num_machines={machines})",
                              outside[0])
        if role.name in with_primary:
            continue
        if role.address:
            raise ConfigError(source, key, "nothing beside `address` (dualrun starts no server for it)",
                              list(role.machines))
        if role.gpu_ids is not None:
            raise ConfigError(source, key, "either `machines` or `gpu_ids` (fixed ids are machine 0's)",
                              list(role.machines))
    _check_trainers(source, machines, roles, groups, with_primary)


def _check_trainers(source: str, machines: int, roles: Sequence[Any], groups: Sequence[Sequence[str]],
                    with_primary: set[str]) -> None:
    given = [r for r in roles if r.name in with_primary and r.machines is not None]
    if not given:
        return
    first = given[0]
    key = f"roles.{first.name}.machines"
    for other in given[1:]:
        if sorted(other.machines) != sorted(first.machines):
            raise ConfigError(source, f"roles.{other.name}.machines", f"the machines of roles.{first.name}."
                              f"machines, {list(first.machines)} (colocated roles share the trainers' machines)",
                              list(other.machines))
    if 0 not in first.machines:
        raise ConfigError(source, key, "a list holding machine 0 (it runs trainer rank 0 and torchrun's store at "
                          "main_process_ip)", list(first.machines))
    ranks = roles[0].processes
    if ranks % len(first.machines):
        raise ConfigError(source, key, f"machines that share the trainers' {ranks} ranks evenly (roles."
                          f"{roles[0].name}: {ranks} over {len(first.machines)} machines)", list(first.machines))
    servers = [r for r in roles if r.name not in with_primary and not r.address]
    if all(r.machines is not None for r in servers):   # else the plan judges, once the servers are placed
        used = set(first.machines).union(*(r.machines for r in servers))
        idle = [m for m in range(machines) if m not in used]
        if idle:
            raise ConfigError(source, key, f"every machine of the job running ranks or servers (machine {idle[0]} "
                              "runs neither: list it here, give it a separate role with `machines`, or lower "
                              "num_machines)", list(first.machines))
