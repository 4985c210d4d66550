"""Shipping a Python function to workers and its return values back (used by `dualrun.launch(fn)`).

cloudpickle (shipped with Ray) pickles functions defined in `__main__` or notebooks by value, so workers need
nothing but the file. Results are written per rank beside the call file. Under torchrun the driver reads them back;
on Ray the call file's bytes travel through each rank's actor (written on its own node) and each rank's result
comes back as the actor's return value, so no node needs to read another node's disk.
"""
from __future__ import annotations

import glob
import os
import pickle
from typing import Any, Callable


def pickler():
    """cloudpickle (a dependency of dualrun's own, whatever the backend): it ships functions from `__main__` by
    value; plain pickle where it is missing (a function of an importable module still travels)."""
    try:
        import cloudpickle
        return cloudpickle
    except ImportError:  # pragma: no cover - a dependency
        return pickle


def save_call(path: str, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None) -> None:
    with open(path, "wb") as f:
        pickler().dump((fn, tuple(args), dict(kwargs or {})), f)


def load_call(path: str) -> tuple[Callable[..., Any], tuple, dict]:
    with open(path, "rb") as f:
        return pickle.load(f)


def result_path(path: str, rank: str | int) -> str:
    return f"{path}.result.{rank}"


def save_result(path: str, rank: str, value: Any) -> None:
    tmp = f"{result_path(path, rank)}.tmp"
    with open(tmp, "wb") as f:
        pickler().dump(value, f)
    os.replace(tmp, result_path(path, rank))


def load_results(path: str) -> dict[int, Any]:
    out = {}
    for name in glob.glob(f"{glob.escape(path)}.result.*"):
        suffix = name.rsplit(".", 1)[-1]
        if suffix.isdigit():
            with open(name, "rb") as f:
                out[int(suffix)] = pickle.load(f)
    return out
