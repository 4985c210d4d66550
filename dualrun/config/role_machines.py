"""`roles.<name>.machines`: the machines a separate role's servers run on (torchrun), read and checked.

Why its own module: the key is read where the role is read (a list of machine ranks) but can only be judged
against the job's other keys (num_machines, the backend, which roles are the trainers')."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from dualrun.config.backends import kind_of, TORCHRUN
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
    """Only a separate role whose servers dualrun starts, only on torchrun, only machines of the job."""
    placed = [r for r in roles if r.machines is not None]
    if not placed:
        return
    backend = values.get("backend", TORCHRUN.name)
    machines = int(acc.get("num_machines") or 1)
    primary = roles[0].name
    with_primary = next((set(g) for g in groups if primary in g), {primary})
    for role in placed:
        key = f"roles.{role.name}.machines"
        if not kind_of(backend).per_machine:
            raise ConfigError(source, key, "no `machines` on the Ray backend (Ray places a role's engines on "
                              "any node with room; use `backend: torchrun`)", list(role.machines))
        if role.name in with_primary:
            raise ConfigError(source, key, "a separate server role (the trainers, and roles colocated with them, "
                              "run on every machine under torchrun)", list(role.machines))
        if role.address:
            raise ConfigError(source, key, "nothing beside `address` (dualrun starts no server for it)",
                              list(role.machines))
        if role.gpu_ids is not None:
            raise ConfigError(source, key, "either `machines` or `gpu_ids` (fixed ids are machine 0's)",
                              list(role.machines))
        outside = [m for m in role.machines if m >= machines]
        if outside:
            raise ConfigError(source, key, f"machine ranks in 0..{machines - 1} (num_machines={machines})",
                              outside[0])
