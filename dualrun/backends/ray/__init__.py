"""The Ray backend, all of it: the cluster connection, placement groups and gangs, the actor classes (rank, server,
role-program worker), the launcher, the servers as actors, the role program's actor groups, and its part of
`dualrun check`. `import ray` happens in this folder alone. `BACKEND` is what the registry
(dualrun/config/backends.py) loads; importing it imports no Ray."""
from __future__ import annotations

from typing import Any

__all__ = ["BACKEND", "RayBackend"]


def __getattr__(attr: str) -> Any:
    """Lazy: a worker process importing a module of this folder (an actor) loads no driver-side code."""
    if attr in __all__:
        from dualrun.backends.ray import ray_backend

        return getattr(ray_backend, attr)
    raise AttributeError(attr)
