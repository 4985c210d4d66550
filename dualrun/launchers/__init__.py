"""Launchers: one per backend, all implementing `dualrun.launchers.launcher.Launcher`; a backend's object
(dualrun/backends/) hands out its own, importing it only then (the Ray launcher imports Ray).
"""
from __future__ import annotations

from dualrun.launchers.launcher import JobResult, Launcher, Program, RankResult

__all__ = ["JobResult", "Launcher", "Program", "RankResult"]
