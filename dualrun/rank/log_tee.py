"""A torchrun rank's output, also appended to `log_dir/<role>_<rank>.log` (the file a Ray rank's actor writes).

Why a copier process (`log_copier.py`): the rank's stdout and stderr stay where torchrun put them (the terminal, or
torchrun's own files), unchanged, and the copy costs the rank no thread and no GIL; a copier outside the rank also
gets every byte the rank wrote before it exited (`os._exit` by the exit guard, or a kill), since what is in the pipes
is read after the rank is gone. One copier takes both streams and writes the file in whole lines, so a line that
reaches its pipe in pieces is not cut by the other stream's. It runs in its own session, so the signals torchrun
sends the rank's group do not cut the copy short; it ends when the last process holding the pipes (the rank, its
children) has closed them.
"""
from __future__ import annotations

import os
import subprocess
import sys

from dualrun.contract.protocol import LOG_DIR, ROLE

COPIER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "log_copier.py")
_copiers: list[subprocess.Popen] = []   # held, never waited for: it ends after the rank, at its pipes' end


def log_path(environ: "os._Environ[str] | dict[str, str]") -> str | None:
    """`LOG_DIR/<role>_<rank>.log` when the launcher asks for it, else None."""
    folder = environ.get(LOG_DIR)
    if not folder:
        return None
    return os.path.join(folder, f"{environ.get(ROLE) or 'train'}_{environ.get('RANK', '0')}.log")


def start(environ: "os._Environ[str] | dict[str, str]" = os.environ) -> str | None:
    """Copy this process's fds 1 and 2 into the rank's log file from here on; the file's path, or None."""
    path = log_path(environ)
    if path is None:
        return None
    os.makedirs(os.path.dirname(path), exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (ValueError, OSError):
            pass
    pipes = [os.pipe() for _ in (1, 2)]
    reads = [read for read, _ in pipes]
    _copiers.append(subprocess.Popen([sys.executable, "-S", COPIER, path, *map(str, reads)], stdin=subprocess.DEVNULL,
                                     stdout=1, stderr=2, pass_fds=reads, close_fds=True, start_new_session=True))
    for fd, (read, write) in zip((1, 2), pipes):
        os.close(read)
        os.dup2(write, fd)
        os.close(write)
    return path
