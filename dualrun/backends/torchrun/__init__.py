"""The torchrun backend, all of it: the launcher (one torchrun agent per machine), the servers of several
machines, the serving-only machine, the machines' watch of each other, and its part of `dualrun check`.
`BACKEND` is what the registry (dualrun/config/backends.py) loads; the rest is imported only when a launch asks."""
from __future__ import annotations

from typing import Any

__all__ = ["BACKEND", "TorchrunBackend"]


def __getattr__(attr: str) -> Any:
    """Lazy: a worker process importing a module of this folder (an actor) loads no driver-side code."""
    if attr in __all__:
        from dualrun.backends.torchrun import torchrun_backend

        return getattr(torchrun_backend, attr)
    raise AttributeError(attr)
