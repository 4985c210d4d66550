"""A torchrun rank's output, also appended to `log_dir/<role>_<rank>.log` (the file a Ray rank's actor writes).

Why a `tee` process per stream: the rank's stdout and stderr stay where torchrun put them (the terminal, or
torchrun's own files), unchanged, and the copy costs the rank no thread and no GIL; a copier outside the rank also
gets every byte the rank wrote before it exited (`os._exit` by the exit guard, or a kill), since what is in the pipe
is read by `tee` after the rank is gone. Each `tee` runs in its own session, so the signals torchrun sends the
rank's group do not cut the copy short; it ends when the last process holding the pipe (the rank, its children)
has closed it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

from dualrun.contract.protocol import LOG_DIR, ROLE

_tees: list[subprocess.Popen] = []   # held, never waited for: each ends after the rank, at its pipe's end


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
    tee = shutil.which("tee")
    if tee is None:
        print(f"dualrun: rank {environ.get('RANK', '0')}: no `tee` program here: {path} is not written",
              file=sys.stderr, flush=True)
        return None
    os.makedirs(os.path.dirname(path), exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (ValueError, OSError):
            pass
    for fd in (1, 2):
        read, write = os.pipe()
        _tees.append(subprocess.Popen([tee, "-a", path], stdin=read, stdout=fd, stderr=subprocess.DEVNULL,
                                      close_fds=True, start_new_session=True))
        os.close(read)
        os.dup2(write, fd)
        os.close(write)
    return path
