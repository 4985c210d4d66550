"""`model`, `engine` and `top_k` of a role, refused where nothing reads them.

Why: these keys are read per method and per placement (the trainers, a role colocated with them, a separate role's
server, a server the user runs at `address`, a role program's group), and a key written where nothing reads it is a
promise nothing keeps. dualrun itself reads `model` and `engine` for a separate role's server (its command line) and
for a role program's groups, and `engine` for a colocated engine role (`colocated_engine_roles`: TRL's colocate
mode); a method plugin names what else its worker half reads (`MethodPlugin.role_key_reads`, e.g. gkd's teacher).
A colocated role keeps what its separate server reads, so that one line (`colocate_groups`) switches a file between
the two layouts, as README's and docs/concepts.md's examples do.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from dualrun.contract.errors import ConfigError

KEYS = ("model", "engine", "top_k")
PLACES = ("trainer", "colocated", "separate", "address", "program")
# what dualrun itself reads, whatever the method
READ_BY_DUALRUN: dict[str, tuple[str, ...]] = {"model": ("separate", "program"), "engine": ("separate", "program"),
                                               "top_k": ()}
_WHERE = {"trainer": "the trainer role", "colocated": "a role colocated with the trainers",
          "separate": "a separate role's server", "address": "a role with `address`",
          "program": "a role program's role"}


def place_of(cfg: Any, role: Any, single_controller: bool) -> str:
    """Where `role` runs, as this module names it (see PLACES)."""
    if single_controller:
        return "program"
    if role.address:
        return "address"
    if role.name == cfg.primary.name:
        return "trainer"
    return "colocated" if role.name in cfg.group_of(cfg.primary.name) else "separate"


def reads(key: str, role: str, place: str, engine_roles: Sequence[str],
          extra: Mapping[str, Mapping[str, Sequence[str]]]) -> bool:
    """Whether `key` of `role` placed at `place` is read (by dualrun, or by the method: `extra`)."""
    if place in READ_BY_DUALRUN[key] or place in extra.get(role, {}).get(key, ()):
        return True
    if place == "colocated" and reads(key, role, "separate", engine_roles, extra):
        return True   # kept for the separate layout: `colocate_groups` alone switches a file between the two
    return key == "engine" and place == "colocated" and role in engine_roles


def unread_role_keys(cfg: Any, engine_roles: Sequence[str] = (), single_controller: bool = False,
                     extra: Mapping[str, Mapping[str, Sequence[str]]] | None = None) -> None:
    """Raise ConfigError for the first role key of KEYS set where nothing reads it (`engine` beside `address` is
    refused earlier, by refusals.external_roles)."""
    extra = extra or {}
    for role in cfg.roles:
        place = place_of(cfg, role, single_controller)
        for key in KEYS:
            value = getattr(role, key)
            if value is None or reads(key, role.name, place, engine_roles, extra):
                continue
            raise ConfigError(cfg.source, f"roles.{role.name}.{key}", f"no {key} on {_WHERE[place]} (nothing "
                              "reads it there)", value,
                              hint=f"method {cfg.method} reads `{key}` {_readers(key, engine_roles, extra)}")


def _readers(key: str, engine_roles: Sequence[str], extra: Mapping[str, Mapping[str, Sequence[str]]]) -> str:
    """Where `key` is read, in words: 'on a separate role's server or roles.teacher (colocated, address)'."""
    parts = [_WHERE[p] for p in READ_BY_DUALRUN[key] if p != "program"]
    if key == "engine" and engine_roles:
        parts.append(" or ".join(f"a colocated {r}" for r in engine_roles))
    parts += [f"roles.{r} ({', '.join(keys[key])})" for r, keys in extra.items() if keys.get(key)]
    return "on " + " or ".join(parts) if parts else "on no role"
