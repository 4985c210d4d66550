"""The role runtime of this process: which backend groups use, the config's groups, the units' Ray placement groups
(held by a backends.ray.cluster.Gang: the Ray resource layer places and removes them).

`dualrun.init()` sets it explicitly; otherwise it is made on first use from the environment a launch left:
`DUALRUN_ROLES_MODE=ray` (set by `dualrun launch --backend ray` for a role program) means Ray, anything else
means local. Group sizes come from `DUALRUN_ROLES_SPEC`, else from the roles in `DUALRUN_SETTINGS` (torchrun),
else every group has one worker.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Callable

from dualrun.contract.protocol import ROLES_MODE, SETTINGS, Settings
from dualrun.role_programs.context import UnknownGroupError
from dualrun.role_programs.modes import mode_of
from dualrun.role_programs.spec import GroupSpec, RolesSpec, load_spec

_LOCK = threading.Lock()
_RUNTIME: "Runtime | None" = None


class Runtime:
    """The groups of this process, in one mode (role_programs/modes.py: `backend` names it)."""

    def __init__(self, spec: RolesSpec, backend: str, track_bytes: bool = False) -> None:
        self.mode = mode_of(backend)
        self.spec, self.backend, self.track_bytes = spec, self.mode.name, track_bytes
        self._pgs: dict[str, Any] = {}      # unit -> its placement group (made by `_placements`)
        self._groups: list[Any] = []
        self._conn: Any = self.mode.connect(spec)
        self._placements: Any = self.mode.placements(spec)   # Ray: the backends.ray.cluster.Gang that places and removes `_pgs`

    def group_spec(self, name: str) -> GroupSpec:
        """The config's group `name`; any name (one worker) when no config is known."""
        if not self.spec.configured:
            return GroupSpec(name, 1, 0, (name,))
        found = self.spec.group(name)
        if found is None:
            known = ", ".join(g.name for g in self.spec.groups)
            raise UnknownGroupError(f"{self.spec.source}: group '{name}' is not a role of the config "
                                    f"(roles: {known}); add it under `roles:` or use one of those")
        return found

    def start_workers(self, spec: GroupSpec, factory: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        return self.mode.workers(self, spec, factory, args, kwargs)

    def placement(self, spec: GroupSpec) -> Any:
        """One placement group per unit, made when its first group starts and kept until shutdown."""
        with _LOCK:
            if spec.unit_name not in self._pgs:
                self._pgs[spec.unit_name] = self.mode.placement(self.spec, spec, self._placements)
            return self._pgs[spec.unit_name]

    def track(self, group: Any) -> None:
        self._groups.append(group)

    def untrack(self, group: Any) -> None:
        if group in self._groups:
            self._groups.remove(group)

    def shutdown(self) -> None:
        """Stop every group's workers and free the placement groups (and Ray, when this runtime started it)."""
        for group in list(self._groups):
            group.shutdown()
        if self._placements is not None:
            self._placements.stop()   # removes every unit's placement group (best effort: the cluster may be gone)
        self._pgs.clear()
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _spec_from_settings() -> RolesSpec:
    roles = Settings.from_env().roles
    return RolesSpec(tuple(GroupSpec(n, int(r.processes or 1), int(r.gpus or 0), (n,), model=r.model, engine=r.engine)
                           for n, r in roles.items()), source=SETTINGS)


def init(config: Any = None, backend: str | None = None, *, track_bytes: bool = False) -> Runtime:
    """Set up the role runtime (optional: groups call it on first use with the defaults).

    config: a YAML path, a config dict, a JobConfig or a RolesSpec (default: what the launch passed).
    backend: 'ray' or 'local' ('torchrun' and 'python' mean local); default: `DUALRUN_ROLES_MODE`, else local.
    """
    global _RUNTIME
    mode = mode_of(backend or os.environ.get(ROLES_MODE) or "local")   # ValueError for an unknown one
    spec = load_spec(config)
    if not spec.configured and config is None:
        spec = _spec_from_settings()
    with _LOCK:
        old, _RUNTIME = _RUNTIME, None
    if old is not None:
        old.shutdown()
    runtime = Runtime(spec, mode.name, track_bytes)
    with _LOCK:
        _RUNTIME = runtime
    return runtime


def get_runtime() -> Runtime:
    if _RUNTIME is None:
        init()
    assert _RUNTIME is not None
    return _RUNTIME


def shutdown() -> None:
    """Stop all groups of this process (actors, placement groups). Safe to call twice."""
    global _RUNTIME
    with _LOCK:
        old, _RUNTIME = _RUNTIME, None
    if old is not None:
        old.shutdown()
