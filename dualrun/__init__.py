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
    # role-program API (docs/roles.md)
    **{name: ("dualrun.role_programs", name) for name in (
        "worker", "function", "WorkerGroup", "init", "shutdown", "current", "get_runtime", "WorkerError",
        "UnknownGroupError", "GroupFuture", "register_dispatch", "register_collect", "DISPATCH", "COLLECT")},
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    if name in ("role_programs", "roles"):   # `import dualrun` then `dualrun.roles.get_runtime()` (the old spelling)
        import importlib

        return importlib.import_module(f"dualrun.{name}")
    raise AttributeError(f"module 'dualrun' has no attribute {name!r}")
