"""Run a function right after a module is imported, without importing it early.

Plugins use this to fill trainer-config fields the user left at their defaults: the hook fires when the
user's script imports TRL, so scripts that never import it pay nothing.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Callable

_pending: dict[str, list[Callable[[object], None]]] = {}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):  # type: ignore[override]
        if fullname not in _pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, fullname)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, name: str) -> None:
        self.inner, self.name = inner, name

    def create_module(self, spec):  # type: ignore[override]
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:  # type: ignore[override]
        self.inner.exec_module(module)
        for fn in _pending.pop(self.name, []):
            fn(module)

    def __getattr__(self, item):
        return getattr(self.inner, item)


_finder = _Finder()


def when_imported(module: str, fn: Callable[[object], None]) -> None:
    """Call `fn(module)` once `module` is imported (now, if it already is)."""
    if module in sys.modules:
        fn(sys.modules[module])
        return
    _pending.setdefault(module, []).append(fn)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
