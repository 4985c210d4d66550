"""The old name of `dualrun.role_programs` (the role-program API), kept so code written against it runs."""
from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    """The new package's public names, read on use. No `__path__` (nor another dunder but `__all__`, for `import *`):
    a submodule imported by the old name would be a second copy of the new one's, with a runtime of its own."""
    if name.startswith("__") and name != "__all__":
        raise AttributeError(f"module 'dualrun.roles' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module("dualrun.role_programs"), name)
