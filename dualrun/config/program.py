"""Checks of the program a job runs (`-m module`), before anything starts. Looks modules up without importing
them: importing a package runs its code (and `trl` would pull in torch)."""
from __future__ import annotations

import os
import re
import sys
from typing import Any

from dualrun.contract.errors import ConfigError

_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
CLI_SOURCE = "<command line>"


def module_exists(name: str) -> bool:
    """Would `python -m name` find it in the launching directory or the installed packages?"""
    from importlib.machinery import PathFinder
    from importlib.util import find_spec

    top, *rest = name.split(".")
    if top in sys.builtin_module_names:
        return not rest
    spec = PathFinder.find_spec(top, [os.getcwd()])   # workers run `python -m` here: cwd is on their path
    if spec is None:
        try:
            spec = find_spec(top)      # a top-level name: finds it without importing anything
        except (ImportError, ValueError):
            return False
    for part in rest:
        if spec is None:
            return False
        places = spec.submodule_search_locations
        if places is None:
            return False               # a plain module has no submodules
        spec = PathFinder.find_spec(part, list(places))
    return spec is not None


def check_module(cfg: Any, name: str) -> None:
    """A one-line error for `-m name` that no worker could run."""
    if not _MODULE.fullmatch(name):
        raise ConfigError(CLI_SOURCE, "training_script", "a module name like pkg.module (with -m)", name)
    if cfg.backend_kind.ray and cfg.ray.runtime_env:
        return   # the workers' runtime_env (working_dir, pip, py_modules) may bring it
    if not module_exists(name):
        raise ConfigError(CLI_SOURCE, "training_script", "a module python -m can find here (-m: the launching "
                          "directory or an installed package)", name)
