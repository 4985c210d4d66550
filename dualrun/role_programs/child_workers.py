"""A local group of more than one worker: one child process per worker, on this machine (torchrun, python).

Why processes: a group's workers form a torch.distributed process group among themselves (a sharded sampler,
an all-reduce of reward scores) only when each is its own process and they run at the same time, as on Ray.
multiprocessing's spawn starts them (a fresh interpreter: safe with CUDA, and no torch imported unless the worker
uses it; each watches this process's id, so none outlives the process that started its group - whichever thread
did: PR_SET_PDEATHSIG would end them with that thread); when one dies, it is named and the others are stopped
(a worker left waiting in a collective would wait forever). Each worker gets its group's RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT (a port free here, picked before any worker starts), not the launcher's. The factory,
calls and results travel as cloudpickle bytes over one pipe per worker, so classes defined in `__main__` need no
import in the child (as on Ray), and the child does not re-run the program (`__main__` is hidden from
multiprocessing while the workers start: a script without an `if __name__ == "__main__"` guard would otherwise
start itself again in every worker). The child side is role_programs/process_worker.py.
"""
from __future__ import annotations

import atexit
import multiprocessing.util  # noqa: F401 - before our atexit handlers: see ProcessWorkers.__init__
import os
import pickle
import sys
import threading
import time
import types
from contextlib import contextmanager
from typing import Any, Callable, Iterator, NoReturn

from dualrun.contract.errors import killed_by
from dualrun.role_programs.context import RemoteFailure, WorkerError, method_name
from dualrun.role_programs.dispatch import CollectFn
from dualrun.role_programs.rendezvous import member_env
from dualrun.role_programs.spec import GroupSpec
from dualrun.role_programs.workers import Calls, GroupFuture, Workers

GRACE_S = 2.0     # how long a SIGTERMed worker gets before SIGKILL
STOP_S = 10.0     # at shutdown: how long workers get to return from their serve loop


def worker_devices(devices: tuple[int, ...], size: int, rank: int) -> tuple[int, ...]:
    """Pure: worker `rank`'s GPUs of its group's `devices` - an equal share each, or (more workers than GPUs)
    one GPU shared round robin."""
    per = len(devices) // size
    return devices[rank * per:(rank + 1) * per] if per else (devices[rank % len(devices)],)


@contextmanager
def _main_hidden() -> Iterator[None]:
    """multiprocessing's spawn re-runs the parent's `__main__` in the child unless `__main__` has no file."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


@contextmanager
def _stopping_on_error(workers: "ProcessWorkers") -> Iterator[None]:
    try:
        yield
    except BaseException:
        workers.shutdown(grace=0.0)
        raise


class ProcessWorkers(Workers):
    """The child processes of one local group; calls are sent to every worker at once and run concurrently."""

    backend = "local"

    def __init__(self, runtime: Any, spec: GroupSpec, factory: Callable[..., Any], args: tuple,
                 kwargs: dict) -> None:
        import multiprocessing

        from dualrun.contract.calls import pickler
        from dualrun.light.ports import free_port
        from dualrun.role_programs.process_worker import serve

        self.spec, self.factory, self.track_bytes = spec, factory, runtime.track_bytes
        self._dumps = pickler().dumps
        self.master = ("127.0.0.1", free_port("127.0.0.1"))
        blob = self._dumps((factory, args, kwargs))
        mp = multiprocessing.get_context("spawn")
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        self.visible: list[str | None] = []
        self.calls = [0] * spec.size
        self.bytes_in = [0] * spec.size
        self._answers: list[dict[int, Any]] = [{} for _ in range(spec.size)]
        self._next_call = 0
        self._lock = threading.RLock()
        # atexit runs last-registered first: multiprocessing's own handler (which joins every child, forever) is
        # registered when multiprocessing.util is first imported - at the first start, after this line, unless
        # imported above - and would then run before this one and wait on workers nobody told to stop
        atexit.register(self.shutdown)
        with _main_hidden(), _stopping_on_error(self):
            for rank in range(spec.size):
                parent, child = mp.Pipe()
                env = member_env(runtime.spec.env, spec, rank, self.master)
                if spec.devices:   # torchrun: the role's GPUs of this machine, shared out as Ray's bundles are
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, worker_devices(spec.devices, spec.size, rank)))
                self.visible.append(env.get("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES")))
                proc = mp.Process(target=serve, args=(child, rank, spec.size, env, spec.name, blob, os.getpid()),
                                  name=f"dualrun-{spec.name}-{rank}")
                proc.start()
                child.close()
                self.conns.append(parent)
                self.procs.append(proc)

    # -- receiving -------------------------------------------------------------------------------------
    def _take(self, rank: int, call_id: int, method: str, timeout: float | None, deadline: float | None) -> Any:
        """Worker `rank`'s answer to `call_id`, keeping earlier answers for their own futures."""
        from multiprocessing.connection import wait

        with self._lock:
            while call_id not in self._answers[rank]:
                conn = self.conns[rank]
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                ready = wait([conn, *self._sentinels()], timeout=left)
                if conn in ready:
                    self._receive(rank, method)
                elif ready:
                    self._died(rank, method)
                elif deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"{self.spec.name}.{method}: no result within {timeout} s")
            return self._answers[rank].pop(call_id)

    def _receive(self, rank: int, method: str) -> None:
        try:
            got_id, value = pickle.loads(self.conns[rank].recv_bytes())
        except (EOFError, OSError):
            self._died(rank, method)
        self._answers[rank][got_id] = value

    def _sentinels(self) -> list[Any]:
        return [p.sentinel for p in self.procs]

    def _died(self, rank: int, method: str) -> NoReturn:
        """A worker ended: stop every worker, then raise naming the one that died (the first gone, else `rank`)."""
        end = time.monotonic() + GRACE_S   # its exit follows its pipe closing within moments
        while not any(p.exitcode is not None for p in self.procs) and time.monotonic() < end:
            time.sleep(0.05)
        gone = [r for r, p in enumerate(self.procs) if p.exitcode is not None]
        failed = gone[0] if gone else rank
        code = self.procs[failed].exitcode
        text = killed_by(code) or (f"exited with code {code}" if code is not None else "closed its pipe")
        pid = self.procs[failed].pid
        self.shutdown(grace=0.0)
        raise WorkerError(self.spec.name, failed, method,
                          RemoteFailure("WorkerExited", f"its process (pid {pid}) {text}; the group was stopped",
                                        f"{self.spec.name} worker rank {failed} (pid {pid}) {text}\n"))

    def wait_ready(self) -> None:
        name = f"{method_name(self.factory)}()"
        for rank in range(self.spec.size):
            failure = self._ready_of(rank, name)
            if failure is not None:
                self.shutdown()
                raise WorkerError(self.spec.name, rank, name, failure)

    def _ready_of(self, rank: int, name: str) -> RemoteFailure | None:
        from multiprocessing.connection import wait

        conn = self.conns[rank]
        if conn in wait([conn, *self._sentinels()]):   # else a worker ended first: `_died` raises
            try:
                return pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                pass
        self._died(rank, name)

    # -- calling ---------------------------------------------------------------------------------------
    def submit(self, method: Any, calls: Calls, collect: CollectFn) -> GroupFuture:
        name = method_name(method)
        with self._lock:
            call_id = self._next_call
            self._next_call += 1
            blobs: dict[tuple, bytes] = {}
            for rank, args, kwargs in calls:
                key = (tuple(map(id, args)), tuple((k, id(v)) for k, v in kwargs.items()))
                if key not in blobs:   # each distinct share is pickled once
                    blobs[key] = pickle.dumps((call_id, self._dumps((method, args, kwargs))))
                try:
                    self.conns[rank].send_bytes(blobs[key])
                except (OSError, ValueError):
                    self._died(rank, name)
                self.calls[rank] += 1
                self.bytes_in[rank] += len(blobs[key])
        ranks = [c[0] for c in calls]

        def fetch(timeout: float | None) -> list:
            deadline = None if timeout is None else time.monotonic() + timeout
            return [self._take(rank, call_id, name, timeout, deadline) for rank in ranks]

        def is_done() -> bool:
            with self._lock:
                for rank in ranks:
                    while call_id not in self._answers[rank] and self.conns[rank].poll(0):
                        self._receive(rank, name)
                return all(call_id in self._answers[rank] for rank in ranks)

        return GroupFuture(self.spec.name, name, ranks, fetch, collect, is_done)

    # -- the rest of the workers' interface ------------------------------------------------------------
    def info(self) -> list[dict[str, Any]]:
        return [{"rank": r, "pid": p.pid, "CUDA_VISIBLE_DEVICES": v} for r, (p, v) in enumerate(zip(self.procs,
                                                                                                   self.visible))]

    def stats(self) -> list[dict[str, Any]]:
        return [{"rank": r, "calls": c, "bytes_in": self.bytes_in[r] if self.track_bytes else None}
                for r, c in enumerate(self.calls)]

    def shutdown(self, grace: float = STOP_S) -> None:
        """Ask every worker to return (waiting up to `grace` s), then SIGTERM / SIGKILL the rest; safe twice."""
        atexit.unregister(self.shutdown)
        for conn in self.conns:
            try:
                conn.send_bytes(b"")
            except (OSError, ValueError):
                pass
        end = time.monotonic() + grace
        for proc in self.procs:
            proc.join(max(0.0, end - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(GRACE_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
