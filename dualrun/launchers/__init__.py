"""Launchers: one per backend, all implementing `dualrun.launchers.base.Launcher`.

The package import is lazy: a Ray worker process imports `dualrun.launchers.ray_worker` for every rank actor, and
must not pay for the launcher base (config, plan, servers: about 0.25 s a process on 2 cores) it never uses.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dualrun.launchers.base import Launcher

_FROM_BASE = ("JobResult", "Launcher", "Program", "RankResult")


def launcher_class(backend: str) -> "type[Launcher]":
    """The Launcher subclass for `backend` (torchrun or ray)."""
    if backend == "ray":
        from dualrun.launchers.ray import RayLauncher

        return RayLauncher
    from dualrun.launchers.torchrun import TorchrunLauncher

    return TorchrunLauncher


def __getattr__(name: str) -> Any:
    if name in _FROM_BASE:
        from dualrun.launchers import base

        return getattr(base, name)
    raise AttributeError(f"module 'dualrun.launchers' has no attribute {name!r}")


__all__ = [*_FROM_BASE, "launcher_class"]
