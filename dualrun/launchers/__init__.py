"""Launchers: one per backend, all implementing `dualrun.launchers.base.Launcher`.

`launcher_class` imports a backend's launcher only when it is asked for (the Ray launcher imports Ray).
"""
from __future__ import annotations

from dualrun.launchers.base import JobResult, Launcher, Program, RankResult


def launcher_class(backend: str) -> "type[Launcher]":
    """The Launcher subclass for `backend` (torchrun or ray)."""
    if backend == "ray":
        from dualrun.launchers.ray import RayLauncher

        return RayLauncher
    from dualrun.launchers.torchrun import TorchrunLauncher

    return TorchrunLauncher


__all__ = ["JobResult", "Launcher", "Program", "RankResult", "launcher_class"]
