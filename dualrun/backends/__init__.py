"""The backends, one package each (`torchrun/`, `ray/`, or another distribution's, through the entry-point group
`dualrun.backends`): what a launch asks of the backend it runs on, found by name in the registry
(dualrun/config/backends.py).

Why objects: the entry points (api.py, cli.py) ask a backend for its launcher (which starts the job's server set),
the cluster `dualrun plan` places onto, its checks before a launch, `dualrun check`'s look at its nodes, and how
the ranks' output reaches the terminal, instead of comparing its name.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dualrun.backends.base import Backend


def __getattr__(attr: str) -> Any:
    """Lazy `Backend`: a worker importing a backend's module (a Ray actor) loads no config."""
    if attr == "Backend":
        from dualrun.backends.base import Backend

        return Backend
    raise AttributeError(attr)


def backend_of(cfg_or_name: Any) -> "Backend":
    """The backend of a JobConfig (or the one named so)."""
    from dualrun.config.backends import backend_object

    return backend_object(cfg_or_name if isinstance(cfg_or_name, str) else cfg_or_name.backend)


__all__ = ["Backend", "backend_of"]
