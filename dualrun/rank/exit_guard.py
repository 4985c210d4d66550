"""A rank whose program has finished always exits, with the program's own exit code (worker side, both backends).

Why: on CPU, gloo's process-group teardown sometimes never returns (TRL's example scripts end with
`trainer.end()`, i.e. `destroy_process_group()`; about one run in four hung a rank there in this project's
tests, under bare torchrun as under any launcher), and C++ destructors that run while the interpreter
finalizes can block the same way. A launcher waits for every rank, so one stuck rank holds the whole job.

What the guard does, in order, once the program has ended (returned, `sys.exit(n)`, or raised):
  1. flush stdout/stderr, then run what Python itself runs at exit: wait for the program's non-daemon threads
     and run its `atexit` handlers (trackers finish, loggers flush) — all under a watchdog;
  2. flush every file the program left open for writing (what finalization would have done);
  3. `os._exit(code)`: the interpreter's finalization, where the C++ teardown can hang, is skipped.
The watchdog (DUALRUN_EXIT_TIMEOUT_S, default 60 s) prints where the rank was stuck (every thread's stack) and
exits with the same code; a C-level fallback (faulthandler, which needs no GIL) fires 15 s later with exit 1.
`destroy_process_group()` itself runs with the same bound, so a script that calls it and then continues is not
held either (it continues after the timeout; the group is abandoned, which is what the process exit does anyway).
Checkpoints are never cut short: they were written (and closed) by the program before it ended.
"""
from __future__ import annotations

import atexit
import faulthandler
import functools
import gc
import io
import os
import sys
import threading
import time
from typing import Any, Callable, NoReturn

from dualrun.contract.protocol import EXIT_TIMEOUT_S

_FALLBACK_S = 15.0


def exit_timeout_s() -> float:
    try:
        value = float(os.environ.get(EXIT_TIMEOUT_S, "60"))
    except ValueError:
        return 60.0
    return value if value > 0 and value == value and value != float("inf") else 60.0


def _say(message: str) -> None:
    rank = os.environ.get("RANK", "0")
    try:
        sys.stderr.write(f"dualrun: rank {rank}: {message}\n")
        sys.stderr.flush()
    except (ValueError, OSError):
        pass


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except (ValueError, OSError):
            pass


def _flush_open_files() -> None:
    """Flush every writable file object still open: `os._exit` skips the finalization that would have."""
    for obj in gc.get_objects():
        try:
            if isinstance(obj, io.IOBase) and not obj.closed and obj.writable():
                obj.flush()
        except Exception:  # noqa: BLE001 - a file that cannot flush now could not have at finalization either
            pass


def _watchdog(code: int, timeout: float, what: str) -> threading.Event:
    """After `timeout` s without `done.set()`: say where the rank is stuck, exit with `code`."""
    done = threading.Event()

    def fire() -> None:
        if done.wait(timeout):
            return
        _say(f"the program ended (exit code {code}) but {what} did not finish within {timeout:g} s "
             f"(DUALRUN_EXIT_TIMEOUT_S); exiting anyway. Where it was stuck:")
        try:
            faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
        except Exception:  # noqa: BLE001
            pass
        _flush_open_files()
        _flush_std()
        os._exit(code)

    threading.Thread(target=fire, name="dualrun-exit-watchdog", daemon=True).start()
    return done


def _join_threads() -> None:
    """What Python does first at exit: its thread-exit callbacks (concurrent.futures' executors shut down there),
    then wait for the program's non-daemon threads. Python's own `threading._shutdown` where it has one."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None and threading.current_thread() is threading.main_thread():
        shutdown()
        return
    me = threading.current_thread()
    for t in threading.enumerate():
        if t is not me and not t.daemon and t is not threading.main_thread():
            t.join()


def finish(code: int, keep: object = None) -> NoReturn:
    """End this rank now that its program has ended: bounded exit work, then `os._exit(code)`. `keep` (the
    program's globals) stays referenced to the end: nothing of the program is destroyed outside the bound."""
    timeout = exit_timeout_s()
    _flush_open_files()
    _flush_std()
    try:  # the GIL-free last resort, should the Python watchdog itself never get to run
        faulthandler.dump_traceback_later(timeout + _FALLBACK_S, exit=True, file=sys.__stderr__)
    except Exception:  # noqa: BLE001
        pass
    done = _watchdog(code, timeout, "its exit (threads still running or atexit handlers)")
    try:
        _join_threads()
        atexit._run_exitfuncs()
    except BaseException as e:  # noqa: BLE001 - an exit handler's error must not change the program's code
        _say(f"an exit handler failed: {type(e).__name__}: {e}")
    _flush_open_files()
    _flush_std()
    done.set()
    os._exit(code)   # `keep` is still referenced here: nothing was freed


def exit_code(exc: BaseException | None) -> int:
    """The code `python script.py` would have exited with."""
    if exc is None:
        return 0
    if isinstance(exc, SystemExit):
        value = exc.code
        if value is None:
            return 0
        if isinstance(value, int):
            return value & 0xFF
        try:
            sys.stderr.write(f"{value}\n")   # sys.exit("message"): Python prints it and exits 1
        except (ValueError, OSError):
            pass
        return 1
    if isinstance(exc, KeyboardInterrupt):
        return 130
    return 1


def bound(fn: Callable[..., Any], what: str) -> Callable[..., Any]:
    """`fn` run in a daemon thread and waited for at most DUALRUN_EXIT_TIMEOUT_S; its errors are re-raised."""
    @functools.wraps(fn)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box["error"] = e

        timeout = exit_timeout_s()
        t = threading.Thread(target=run, name=f"dualrun-{what}", daemon=True)
        started = time.monotonic()
        t.start()
        t.join(timeout)
        if t.is_alive():
            _say(f"{what} did not return within {time.monotonic() - started:.0f} s (DUALRUN_EXIT_TIMEOUT_S; "
                 "a known gloo teardown hang); continuing without it")
            return None
        if "error" in box:
            raise box["error"]
        return box.get("value")

    bounded._dualrun_bounded = True  # type: ignore[attr-defined]
    return bounded


def _bound_teardown(module: Any) -> None:
    """torch.distributed imported: its `destroy_process_group` gets the exit bound (both names of it)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    original = c10d.destroy_process_group
    if getattr(original, "_dualrun_bounded", False):
        return

    def destroy(*args: Any, **kwargs: Any) -> Any:
        # the teardown runs in a helper thread: give it the caller's CUDA device (a new thread starts on device 0)
        torch = sys.modules.get("torch")
        device = torch.cuda.current_device() if torch is not None and torch.cuda.is_initialized() else None

        def run() -> Any:
            if device is not None:
                torch.cuda.set_device(device)
            return original(*args, **kwargs)

        return bound(run, "destroy_process_group()")()

    bounded = functools.wraps(original)(destroy)
    bounded._dualrun_bounded = True  # type: ignore[attr-defined]
    c10d.destroy_process_group = bounded
    dist.destroy_process_group = bounded


def activate() -> None:
    from dualrun.rank.hooks import when_imported

    if "torch.distributed" in sys.modules:
        _bound_teardown(sys.modules["torch.distributed"])
    else:
        when_imported("torch.distributed", _bound_teardown)
