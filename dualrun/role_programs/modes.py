"""How a role program's worker groups run: as Ray actors, or in and beside the driver's own process (the role
runtime's mode). One object per mode, looked up by name here and nowhere else.

Why objects: the runtime (runtime.py) asks its mode to join a cluster, to place a unit and to start a group's
workers, and `dualrun plan` and a launch ask it how to describe the groups; none of them compares a name. A launch's
backend names its groups' mode (config/backends.py, `groups`), which reaches the driver as `DUALRUN_ROLES_MODE`.
"""
from __future__ import annotations

from typing import Any, Callable

from dualrun.role_programs.spec import GroupSpec, RolesSpec


class GroupsMode:
    """`name`: what `WorkerGroup.backend` reports. `spread`: its workers may run on any node of a cluster (else
    they are processes of the driver's machine)."""

    name = ""
    spread = False
    driver = "driver"   # what runs the program, in the groups' table
    where = ""          # where each worker runs, in the groups' table

    def connect(self, spec: RolesSpec) -> Any:
        """Join what the groups run on; the connection to close at shutdown (None: nothing to close)."""
        return None

    def placements(self, spec: RolesSpec) -> Any:
        """What places and removes the units' resources (None: nothing to place)."""
        return None

    def devices(self, group: GroupSpec) -> str:
        """A group's devices in the groups' table."""
        if group.gpus and not group.devices:
            return f"{group.gpus} GPU(s), one per worker"
        return "GPU " + ",".join(map(str, group.devices)) if group.gpus else "CPU"

    def workers(self, runtime: Any, spec: GroupSpec, factory: Callable[..., Any], args: tuple,
                kwargs: dict) -> Any:
        """A group's started workers (role_programs/workers.py `Workers`)."""
        raise NotImplementedError

    def placement(self, spec: RolesSpec, group: GroupSpec, placements: Any) -> Any:
        """The placement of `group`'s unit, made once per unit by the runtime (None: nothing to place)."""
        return None


class LocalGroups(GroupsMode):
    """A group of one worker in the driver itself; a larger one a child process per worker
    (role_programs/child_workers.py), on the devices the plan gives its role on this machine."""

    name = "local"
    where = "each worker a child process of the driver, a group of one worker in the driver itself"

    def workers(self, runtime: Any, spec: GroupSpec, factory: Callable[..., Any], args: tuple,
                kwargs: dict) -> Any:
        if spec.size > 1:   # its workers run at the same time, each its own process (a process group of theirs)
            from dualrun.role_programs.child_workers import ProcessWorkers

            return ProcessWorkers(runtime, spec, factory, args, kwargs)
        from dualrun.role_programs.workers import LocalWorkers

        return LocalWorkers(spec, factory, args, kwargs)


LOCAL_GROUPS = LocalGroups()
# `dualrun.init(backend=...)` names of the core's own mode; any other is a backend's name, whose object gives its
# mode (`Backend.groups_mode`: Ray's actors, or these local processes)
MODES: dict[str, GroupsMode] = {"local": LOCAL_GROUPS, "python": LOCAL_GROUPS}


def groups_table(spec: RolesSpec, mode: str = "ray") -> str:
    """What `dualrun plan` and a launch print for a role program: the one driver, each group, its workers and
    devices (docs/roles.md: the program runs once; its groups are started once), in `mode`."""
    groups = mode_of(mode)
    lines = [f"role program: runs once, as the {groups.driver} on this machine; groups: {groups.where}"]
    for g in spec.groups:
        shared = f"  shares devices with {', '.join(r for r in g.unit if r != g.name)}" if len(g.unit) > 1 else ""
        lines.append(f"  {g.name:<10} {g.size} worker(s), {groups.devices(g)}{shared}")
    return "\n".join(lines)


def mode_of(name: str) -> GroupsMode:
    """The mode named `name` (a mode, or an installed backend's name); ValueError naming the known ones."""
    from dualrun.config.backends import UnknownBackend, backend_object, installed

    if name in MODES:
        return MODES[name]
    try:
        return backend_object(name).groups_mode()
    except UnknownBackend:
        raise ValueError(f"backend={name!r}: expected one of {sorted({*MODES, *installed()})}") from None
