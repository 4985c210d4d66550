"""The backends, one object each: what a launch asks of the backend it runs on.

Why objects: the entry points (api.py, cli.py) ask a backend for its launcher (which starts the job's server set),
the cluster `dualrun plan` places onto, its checks before a launch, `dualrun check`'s look at its nodes, and how
the ranks' output reaches the terminal, instead of comparing its name. The layers below the launchers read what a
backend is like from its record (config/backends.py: the plan's placement policy, a role program's groups mode,
the config's checks); the name is looked up there, once, and the record keys the objects here.
"""
from __future__ import annotations

from typing import Any

from dualrun.backends.base import Backend
from dualrun.config.backends import RAY, TORCHRUN, BackendKind, kind_of


def backend_of(cfg_or_name: Any) -> Backend:
    """The backend of a JobConfig (or the one named so)."""
    from dualrun.backends.ray import RayBackend
    from dualrun.backends.torchrun import TorchrunBackend

    kind: BackendKind = kind_of(cfg_or_name) if isinstance(cfg_or_name, str) else cfg_or_name.backend_kind
    return {TORCHRUN: TorchrunBackend, RAY: RayBackend}[kind]()


__all__ = ["Backend", "backend_of"]
