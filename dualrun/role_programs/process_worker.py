"""Runs inside each child process of a local group (role_programs/child_workers.py): build the worker, then serve calls.

Why a module of its own: it is what the spawned interpreter imports, so it stays small (no Ray, no torch: a
worker that needs torch imports it itself). Messages are cloudpickle bytes over one pipe: the parent
sends `(call_id, blob of (method, args, kwargs))`, the worker answers `(call_id, result)` in order; an empty message (or
the parent's end closing) means stop.
"""
from __future__ import annotations

import os
import pickle
from typing import Any

from dualrun.contract import protocol
from dualrun.light.parent_death import exit_with_process
from dualrun.role_programs.context import RemoteFailure, WorkerContext, call_safely, set_actor_context
from dualrun.role_programs.workers import bind

# What torchrun tells the process that started the group: a worker must not see it (TORCHELASTIC_USE_AGENT_STORE
# would make init_process_group() look for the agent's store on the group's port and hang).
LAUNCHER_NAMES = ("GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE")


def _dumps(value: Any) -> bytes:
    """Plain pickle where it does (answers are mostly data): a worker whose factory and calls came by reference
    then never imports cloudpickle, which comes with Ray (~0.5 CPU-s per worker). cloudpickle for the rest: a
    closure, or an instance of a class that came by value (pickle cannot find it here, so it refuses)."""
    try:
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - pickle refuses with PicklingError, TypeError or AttributeError
        from dualrun.contract.calls import pickler

        return pickler().dumps(value)


def _enter(env: dict[str, str], group: str, rank: int, size: int) -> None:
    for name in [n for n in os.environ if n.startswith("TORCHELASTIC_") or n in LAUNCHER_NAMES]:
        del os.environ[name]
    os.environ.update(env)
    os.environ[protocol.ROLES_MODE] = "local"   # groups made inside a worker are local to it
    set_actor_context(WorkerContext(group, rank, size, "local", env["MASTER_ADDR"], int(env["MASTER_PORT"])))


def serve(conn: Any, rank: int, size: int, env: dict[str, str], group: str, blob: bytes, parent: int) -> None:
    """The child's entry: returns (exit code 0) when told to stop; a crash is its exit code."""
    # No worker outlives the process that started its group, even when the thread that started it has ended
    # (PR_SET_PDEATHSIG would fire then: a group made in a worker thread would die with that thread).
    exit_with_process(parent)
    _enter(env, group, rank, size)
    try:
        factory, args, kwargs = pickle.loads(blob)
        obj = call_safely(factory, args, kwargs)
    except Exception as exc:  # noqa: BLE001 - e.g. the class's module cannot be imported here
        obj = RemoteFailure.capture(exc)
    conn.send_bytes(_dumps(obj if isinstance(obj, RemoteFailure) else None))
    while True:
        try:
            msg = conn.recv_bytes()
        except EOFError:
            return
        if not msg:
            return
        call_id, call = pickle.loads(msg)
        try:
            method, args, kwargs = pickle.loads(call)
        except Exception as exc:  # noqa: BLE001 - e.g. an argument whose class cannot be imported here
            result = RemoteFailure.capture(exc)
        else:
            result = obj if isinstance(obj, RemoteFailure) else call_safely(bind(obj, method), args, kwargs)
        try:
            out = _dumps((call_id, result))
        except Exception as exc:  # noqa: BLE001 - a result that cannot travel is that call's failure
            out = _dumps((call_id, RemoteFailure.capture(exc)))
        conn.send_bytes(out)
