"""Which backends are installed and what each is like: the one place a backend's name is looked up.

Why a registry below everything that runs a backend: the layers under the launchers ask what a backend does (is
every machine launched by hand? does it place through Ray? how does a role program's group run?), never which one
it is. Each backend is a package of its own (`dualrun/backends/<name>/`, or another distribution's) whose
`BACKEND` object carries its record (`BackendKind`); the built-in ones are found by their package name, others
through the entry-point group `dualrun.backends` (as method plugins are through `dualrun.plugins`). Nothing here
imports a backend's package but by name, at first use, so the core depends on no backend.
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from dualrun.contract.protocol import BACKEND_ENTRY_POINTS

# The backends that come with dualrun: (name, package holding its BACKEND), in the order `--help` lists them.
BUILT_IN = (("torchrun", "dualrun.backends.torchrun"), ("ray", "dualrun.backends.ray"))
DEFAULT = "torchrun"


@dataclass(frozen=True)
class BackendKind:
    """`per_machine`: each machine's share is explicit in the plan (its ranks, its servers, `roles.<name>.machines`
    index the machines), every machine alike: torchrun launches each machine's share by hand (like `accelerate
    launch`; a machine's ranks, servers and a role program's groups run on the machine that launches them), SLURM
    from one launch through srun (its machine_rank is always 0).
    `ray`: places its processes through a Ray cluster it joins or starts (needs the ray package; the `ray.*`
    keys apply). `groups`: how a role program's worker groups run, the role runtime's mode (`DUALRUN_ROLES_MODE`):
    'ray' actors, or 'local' processes of the driver. `placement`:
    its placement policy, `JobConfig -> plan.placement.Placement` (the core's `MachinesPlacement`, or its own).
    `fleets`: its server set starts and stops a role's spare replicas while the job runs (`min_replicas`,
    `max_replicas`; a per-machine backend only on one machine)."""

    name: str
    per_machine: bool
    ray: bool
    groups: str
    placement: Callable[[Any], Any] = field(compare=False, repr=False, default=None)   # type: ignore[assignment]
    fleets: bool = False

    def files_here(self, cfg: Any) -> bool:
        """Whether a local path of the config (a model) is read on this machine's file system: one launch per
        machine, or an embedded cluster started here (a joined cluster's nodes have their own)."""
        return self.per_machine or (self.ray and cfg.ray.address == "local")


class UnknownBackend(KeyError):
    """A backend name that is not installed; `str()` names those that are."""

    def __init__(self, name: str, why: str = "") -> None:
        super().__init__(name)
        self.name, self.why = name, why

    def __str__(self) -> str:
        return self.why or f"one of {', '.join(installed())} (the installed backends)"


@functools.lru_cache(maxsize=1)
def _built_in() -> dict[str, Any]:
    """name -> BACKEND of the backends that come with dualrun (no package metadata read: a launch's start-up)."""
    return {name: importlib.import_module(package).BACKEND for name, package in BUILT_IN}


@functools.lru_cache(maxsize=1)
def _registered() -> dict[str, Any]:
    """name -> BACKEND (or why it does not load, a string) of the other distributions' entry points; a built-in
    name is not replaced. Read only when a name is not built in, or the list is asked for."""
    from importlib.metadata import entry_points

    found: dict[str, Any] = {}
    for ep in entry_points(group=BACKEND_ENTRY_POINTS):
        if ep.name in dict(BUILT_IN) or ep.name in found:
            continue
        try:
            obj = ep.load()
            found[ep.name] = obj() if isinstance(obj, type) else obj
        except Exception as e:   # a broken third-party package: said when it is asked for, not before
            found[ep.name] = (f"a backend that loads (backend {ep.name!r} is installed but does not load: "
                              f"{type(e).__name__}: {e})")
    return found


def installed() -> tuple[str, ...]:
    """The names `--backend` and the config's `backend` accept."""
    return tuple(_built_in()) + tuple(n for n, obj in _registered().items() if not isinstance(obj, str))


def backend_object(name: str) -> Any:
    """The BACKEND object of `name` (a `dualrun.backends.base.Backend`); UnknownBackend when none is."""
    obj = _built_in().get(name)
    if obj is None:
        obj = _registered().get(name)
    if obj is None:
        raise UnknownBackend(name)
    if isinstance(obj, str):
        raise UnknownBackend(name, obj)
    return obj


def kind_of(name: str) -> BackendKind:
    """The record of the backend named `name` (the config's `backend`, checked against `installed()` on load)."""
    return backend_object(name).kind


def section_owner(section: str) -> Any | None:
    """The installed backend whose own config section is `section` (it declares the section's keys, `section_keys`:
    a plug-in's section is checked as the core's are); None: no backend owns it. Asked only of a top-level key the
    core does not know, so a config without one reads no package metadata."""
    for name in installed():
        obj = backend_object(name)
        if getattr(obj, "section", None) == section and getattr(obj, "section_keys", ()):
            return obj
    return None


def owned_sections(shipped_only: bool = True) -> dict[str, Any]:
    """section -> its backend, for every installed backend that declares its section's keys (`shipped_only`: the
    ones in dualrun's own package, which docs/config-reference.md lists)."""
    out: dict[str, Any] = {}
    for name in installed():
        obj = backend_object(name)
        if getattr(obj, "section_keys", ()) and (not shipped_only or type(obj).__module__.startswith("dualrun.")):
            out.setdefault(obj.section, obj)
    return out


def machines_found(name: str, environ: Any) -> tuple[int, str] | None:
    """(count, what they are) of the machines backend `name` finds where it is launched, for a config that leaves
    num_machines unset (a scheduler's allocation); None: it finds none (one machine)."""
    found = getattr(backend_object(name), "machines_found", None)
    return found(environ) if found is not None else None
