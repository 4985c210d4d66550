"""What each backend is like, as the config's checks, the plan, the method plugins and the role runtime need to
know it: one record per backend, looked up by its name here and nowhere else.

Why a record below everything that runs a backend: the layers under the launchers ask what a backend does (is
every machine launched by hand? does it place through Ray? how does a role program's group run?), never which
one it is; the objects that run a backend (dualrun/backends/) sit above them all and carry the same record.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BackendKind:
    """`per_machine`: launched on every machine by hand, every machine alike (torchrun, like `accelerate
    launch`): a machine's ranks, servers and a role program's groups run on the machine that launches them.
    `ray`: places its processes through a Ray cluster it joins or starts (needs the ray package; the `ray.*`
    keys apply). `groups`: how a role program's worker groups run, the role runtime's mode (`DUALRUN_ROLES_MODE`):
    'ray' actors, or 'local' processes of the driver."""

    name: str
    per_machine: bool
    ray: bool
    groups: str

    def files_here(self, cfg: Any) -> bool:
        """Whether a local path of the config (a model) is read on this machine's file system: one launch per
        machine, or an embedded cluster started here (a joined cluster's nodes have their own)."""
        return self.per_machine or cfg.ray.address == "local"


TORCHRUN = BackendKind("torchrun", per_machine=True, ray=False, groups="local")
RAY = BackendKind("ray", per_machine=False, ray=True, groups="ray")
KINDS = {kind.name: kind for kind in (TORCHRUN, RAY)}


def kind_of(name: str) -> BackendKind:
    """The record of the backend named `name` (the config's `backend`, validated against `KINDS` by the schema)."""
    return KINDS[name]
