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


def module_spec(name: str) -> Any:
    """The spec `python -m name` would run from the launching directory or the installed packages (None: none)."""
    from importlib.machinery import ModuleSpec, PathFinder
    from importlib.util import find_spec

    top, *rest = name.split(".")
    if top in sys.builtin_module_names:
        return None if rest else ModuleSpec(top, None, origin="built-in")
    spec = PathFinder.find_spec(top, [os.getcwd()])   # workers run `python -m` here: cwd is on their path
    if spec is None:
        try:
            spec = find_spec(top)      # a top-level name: finds it without importing anything
        except (ImportError, ValueError):
            return None
    for part in rest:
        if spec is None:
            return None
        places = spec.submodule_search_locations
        if places is None:
            return None                # a plain module has no submodules
        spec = PathFinder.find_spec(part, list(places))
    return spec


def module_exists(name: str) -> bool:
    """Would `python -m name` find it in the launching directory or the installed packages?"""
    return module_spec(name) is not None


_SCAN_BYTES = 4 << 20   # a program's source read for the names it uses: past this, not read


def program_source(target: str, module: bool) -> str | None:
    """The source file the workers start with: the script, or what `python -m target` runs (a package's
    `__main__`); None where there is none to read (built-in, compiled, a pickled call)."""
    if not module:
        return target if os.path.isfile(target) else None
    spec = module_spec(target)
    if spec is not None and spec.submodule_search_locations is not None:   # a package: its __main__
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec("__main__", list(spec.submodule_search_locations))
    origin = getattr(spec, "origin", None)
    return origin if origin and origin.endswith(".py") and os.path.isfile(origin) else None


def names_used(path: str) -> frozenset[str]:
    """Every name the file's code mentions (names, attributes, imported names), read without running it; empty
    when it cannot be read or parsed (the program's own run then says why)."""
    import ast

    try:
        if os.path.getsize(path) > _SCAN_BYTES:
            return frozenset()
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
        return frozenset()
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add(node.name.rpartition(".")[2])
    return frozenset(names)


def check_module(cfg: Any, name: str) -> None:
    """A one-line error for `-m name` that no worker could run."""
    if not _MODULE.fullmatch(name):
        raise ConfigError(CLI_SOURCE, "training_script", "a module name like pkg.module (with -m)", name)
    if cfg.backend_kind.ray and cfg.ray.runtime_env:
        return   # the workers' runtime_env (working_dir, pip, py_modules) may bring it
    if not module_exists(name):
        raise ConfigError(CLI_SOURCE, "training_script", "a module python -m can find here (-m: the launching "
                          "directory or an installed package)", name)
