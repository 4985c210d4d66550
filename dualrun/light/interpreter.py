"""The interpreter placeholder of commands built on the driver and run on some node.

Why a placeholder: the driver builds every worker and server command, but a Ray actor on another node must run
*that node's* Python (its venv may live elsewhere), so argv[0] names no path until the process that spawns the
command replaces it with its own interpreter. Standard library only: Ray worker processes import it.
"""
from __future__ import annotations

import sys
from typing import Sequence

PYTHON = "<python>"


def resolve(argv: Sequence[str], python: str | None = None) -> list[str]:
    """`argv` with a leading PYTHON replaced by this node's interpreter (or `python`); other commands unchanged."""
    argv = [str(a) for a in argv]
    if argv and argv[0] == PYTHON:
        argv[0] = python or sys.executable
    return argv
