"""The worker half of a method plugin: what every worker activates before the user's script runs.

Why apart from `dualrun.methods.plugin` (the driver half): a plugin's driver half validates the config and names its
servers' command lines (dualrun.methods.commands); a worker only installs import hooks. Resolving the worker half
here keeps a rank from importing the config, the plan or anything that starts a server.

A built-in method's worker half is the module `dualrun.plugins.workers.<method>_worker` (its `activate(settings)`); a
built-in method without one activates nothing. A third-party method (entry-point group `dualrun.plugins`) keeps
both halves in its `MethodPlugin`: its `activate` runs here.
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Mapping

from dualrun.contract.protocol import PLUGIN_ENTRY_POINTS, Settings

WORKER_PACKAGE = "dualrun.plugins.workers"


def worker_settings(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The job settings (DUALRUN_SETTINGS) as the plain mapping a worker half's `activate` takes."""
    return Settings.from_env(environ).to_dict()


def worker_half(method: str) -> Any | None:
    """What `activate(settings)` is called on for `method`; None when the method installs nothing in a worker."""
    if method.startswith("_"):
        return None
    try:
        return importlib.import_module(f"{WORKER_PACKAGE}.{method}_worker")
    except ModuleNotFoundError as e:
        if e.name != f"{WORKER_PACKAGE}.{method}_worker":
            raise
    if importlib.util.find_spec(f"dualrun.plugins.{method}") is not None:   # built-in, nothing for workers
        return None
    from importlib.metadata import entry_points

    for ep in entry_points(group=PLUGIN_ENTRY_POINTS):
        if ep.name == method:
            plugin = ep.load()
            return plugin() if isinstance(plugin, type) else plugin
    return None


def activate(method: str, settings: Mapping[str, Any] | None = None) -> None:
    """Install `method`'s hooks in this worker (settings: DUALRUN_SETTINGS unless given)."""
    half = worker_half(method)
    if half is not None:
        half.activate(worker_settings() if settings is None else settings)
