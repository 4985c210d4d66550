"""The one worker entry point of both backends.

    python -m dualrun.rank.bootstrap script.py args...  |  python -m dualrun.rank.bootstrap -m package.module args...
    python -m dualrun.rank.bootstrap --call FILE   (Python API: a pickled function; its result is written beside FILE)

The environment is already set when this starts (by torchrun or by the Ray worker actor). It activates the
method plugin's hooks, then runs the user's program unchanged as `__main__` with its own argv. An uncaught
exception is recorded in TORCHELASTIC_ERROR_FILE (torch's format) so the launcher can name the failing rank
and its error, whichever backend ran it. No process group is destroyed while the program runs
(dualrun/rank/keep_groups.py), and once the program has ended the rank exits with the program's own code even when
the process-group teardown hangs (dualrun/rank/exit_guard.py).
"""
from __future__ import annotations

import os
import runpy
import sys


def _record(exc: BaseException) -> None:
    """torch's error-file format (what ErrorHandler.record_exception writes), but written whole or not at all: when
    another rank dies, the launcher SIGTERMs this one, possibly mid-write, and then parses the file; torch's own
    writer truncates first, and an empty file made torchrun's agent raise JSONDecodeError instead of restarting."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    import json
    import tempfile
    import time
    import traceback

    data = {"message": {"message": f"{type(exc).__name__}: {exc}", "extraInfo": {
        "py_callstack": "".join(traceback.format_exception(exc)), "timestamp": str(int(time.time()))}}}
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".error-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _activate_plugin() -> None:
    from dualrun.rank.atomic_save import activate as activate_atomic_saves
    from dualrun.rank.resume import activate as activate_resume
    from dualrun.rank.trainer_defaults import activate as activate_defaults

    activate_atomic_saves()   # no half-written checkpoint-N when a rank is stopped mid-save
    activate_resume()
    activate_defaults()
    from dualrun.contract.protocol import METHOD

    method = os.environ.get(METHOD)
    if not method:
        return
    from dualrun.rank.method import activate

    activate(method)   # the plugin's worker half (dualrun/rank/method.py)


def _call(path: str) -> object:
    """Python API: call a pickled function and leave its return value next to it for the driver."""
    from dualrun.contract.calls import load_call, save_result

    fn, args, kwargs = load_call(path)
    value = fn(*args, **kwargs)
    save_result(path, os.environ.get("RANK", "0"), value)
    return value


def _run(argv: list[str]) -> object:
    """Run the program; return its globals (kept alive: freeing them runs destructors, a teardown of its own)."""
    if argv[0] == "--call":
        return _call(argv[1])
    elif argv[0] == "-m":
        if len(argv) < 2:
            sys.exit("usage: python -m dualrun.rank.bootstrap -m module [args...]")
        sys.argv = [argv[1]] + argv[2:]
        return runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = argv[0]
        sys.argv = argv
        here = os.path.dirname(os.path.abspath(script))
        if sys.path and sys.path[0] in ("", os.getcwd()):
            sys.path[0] = here  # exactly what `python script.py` would have
        else:
            sys.path.insert(0, here)
        return runpy.run_path(script, run_name="__main__")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        sys.exit("usage: python -m dualrun.rank.bootstrap (script.py | -m module) [args...]")
    from dualrun.light import loopback_store
    from dualrun.rank import exit_guard, keep_groups, log_tee, server_auth, server_cores, server_wait

    log_tee.start()   # torchrun with log_dir: the rank's output also goes to log_dir/<role>_<rank>.log

    from dualrun.rank.store_wiring import share

    share()   # multi-node torchrun: the servers' addresses, from the machine that started them
    loopback_store.activate()   # one machine: the rank's stores (rank 0's on Ray) listen on loopback alone
    server_auth.activate()   # TRL's clients carry the job's secret (and a role's --api-key) to its servers
    server_wait.activate()   # servers started beside the trainers: a first connection waits while one starts
    server_cores.activate()   # ...and the servers starting on this machine get cores of their own meanwhile
    _activate_plugin()
    keep_groups.activate()   # no process group is destroyed before the rank's exit (dualrun/rank/keep_groups.py)
    exit_guard.activate()
    ended: BaseException | None = None
    kept = None
    try:
        kept = _run(argv)
    except SystemExit as exc:
        ended = exc
    except BaseException as exc:  # noqa: BLE001 - recorded and printed as Python would, then the rank exits
        _record(exc)
        sys.excepthook(type(exc), exc, exc.__traceback__)
        ended = exc
    # the program has ended: this rank exits now, with its code, whatever the teardown does (dualrun/rank/exit_guard.py)
    exit_guard.finish(exit_guard.exit_code(ended), keep=kept)


if __name__ == "__main__":
    main()
