"""dualrun: run unchanged Hugging Face / TRL training scripts on torchrun or Ray by changing one flag.

The package import is cheap: the public API is loaded on first use.
"""
from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "launch": ("dualrun.api", "launch"),
    "JobResult": ("dualrun.launchers.launcher", "JobResult"),
    "load_config": ("dualrun.config", "load_config"),
    "ConfigError": ("dualrun.contract.errors", "ConfigError"),
    # role-splitting API (docs/roles.md)
    **{name: ("dualrun.roles", name) for name in (
        "worker", "function", "WorkerGroup", "init", "shutdown", "current", "WorkerError", "UnknownGroupError",
        "GroupFuture", "register_dispatch", "register_collect")},
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'dualrun' has no attribute {name!r}")
