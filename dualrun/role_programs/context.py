"""Small shared pieces: who am I (group, rank), the in-worker flag, and how failures travel back.

Imported inside Ray actors too, so it stays free of Ray and torch.
"""
from __future__ import annotations

import contextvars
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from dualrun.contract.errors import DualrunError


@dataclass(frozen=True)
class WorkerContext:
    """Where the current code runs: inside worker `rank` of `group` (of `world_size`), and the group's own
    torch.distributed rendezvous (role_programs/rendezvous.py)."""

    group: str
    rank: int
    world_size: int
    backend: str  # 'ray' | 'local'
    master_addr: str | None = None
    master_port: int | None = None


_CTX: contextvars.ContextVar[WorkerContext | None] = contextvars.ContextVar("dualrun_worker", default=None)
_ACTOR_CTX: list[WorkerContext] = []  # set once in a Ray actor (its whole process is that worker)


def current() -> WorkerContext | None:
    """The worker context of the running code; None on the driver."""
    return _CTX.get() or (_ACTOR_CTX[0] if _ACTOR_CTX else None)


def in_worker() -> bool:
    return current() is not None


@contextmanager
def as_worker(ctx: WorkerContext) -> Iterator[None]:
    """Run a block as worker `ctx`: decorated classes constructed here are plain instances."""
    token = _CTX.set(ctx)
    try:
        yield
    finally:
        _CTX.reset(token)


def set_actor_context(ctx: WorkerContext) -> None:
    _ACTOR_CTX[:] = [ctx]


@dataclass(frozen=True)
class RemoteFailure:
    """A worker's exception, as a value (its traceback text survives any pickling)."""

    exc_type: str
    message: str
    traceback: str

    @staticmethod
    def capture(exc: BaseException) -> "RemoteFailure":
        return RemoteFailure(type(exc).__name__, str(exc),
                             "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))


class UnknownGroupError(DualrunError, LookupError):
    """A group that is not a role of the config."""

    exit_code = 2


class WorkerError(DualrunError, RuntimeError):
    """A worker failed inside a call: names the group, the rank, the method, and carries its traceback."""

    def __init__(self, group: str, rank: int, method: str, failure: RemoteFailure) -> None:
        self.group, self.rank, self.method, self.failure = group, rank, method, failure
        self.remote_traceback = failure.traceback
        super().__init__(f"{group} worker rank {rank} failed in {method}: {failure.exc_type}: {failure.message}"
                         f"\n--- traceback of {group} rank {rank} ---\n{failure.traceback.rstrip()}")


def call_safely(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """fn(*args, **kwargs), or a RemoteFailure instead of raising."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - reported on the driver with rank and traceback
        exc.__traceback__ = exc.__traceback__.tb_next if exc.__traceback__ else None  # drop this frame
        return RemoteFailure.capture(exc)


def method_name(method: Any) -> str:
    return method if isinstance(method, str) else getattr(method, "__qualname__", repr(method))
