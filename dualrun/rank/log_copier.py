"""The copier behind `log_tee`: a rank's stdout and stderr, passed on to where they went unchanged, and appended to
the rank's log file in whole lines.

Why whole lines: the two streams reach the file through one copier each way, and a program's line often reaches its
pipe in pieces (`print("loss", x)` is three writes on an unbuffered stream, as Python's is under torchrun); copied
as they come, a stdout piece could land inside a stderr line ("err of rankout of rank 1"). The terminal still gets
every piece at once (progress bars stay live); the file gets each stream's bytes up to its last newline, the rest
with the next piece (or at the end, or once `PENDING_LIMIT` bytes wait without a newline).

Run as a script (`python -S log_copier.py LOG_PATH OUT_FD ERR_FD`, fds of the pipes' read ends): standard library
only, no dualrun import, so it starts in milliseconds and needs nothing from the rank's environment.
"""
from __future__ import annotations

import os
import select
import sys

PENDING_LIMIT = 1 << 16   # bytes of a line without its newline kept back from the file before they go anyway
CHUNK = 1 << 16


class Lines:
    """Pure: one stream's bytes in, the bytes that end a line (or overflow `limit`) out."""

    def __init__(self, limit: int = PENDING_LIMIT) -> None:
        self.pending, self.limit = b"", limit

    def feed(self, data: bytes) -> bytes:
        data = self.pending + data
        cut = data.rfind(b"\n") + 1
        if len(data) - cut > self.limit:
            cut = len(data)
        self.pending = data[cut:]
        return data[:cut]

    def rest(self) -> bytes:
        rest, self.pending = self.pending, b""
        return rest


def _write_all(fd: int, data: bytes) -> bool:
    """Write every byte; False once `fd` is gone (a closed terminal: the file still gets them)."""
    try:
        while data:
            data = data[os.write(fd, data):]
        return True
    except OSError:
        return False


def copy(log_path: str, sources: dict[int, int]) -> None:
    """Until every source pipe is closed: each chunk read from a source fd to its target fd, whole lines to the file."""
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    lines = {fd: Lines() for fd in sources}
    live_targets = set(sources.values())
    open_fds = set(sources)
    while open_fds:
        ready, _, _ = select.select(list(open_fds), [], [])
        for fd in ready:
            try:
                data = os.read(fd, CHUNK)
            except InterruptedError:
                continue
            target = sources[fd]
            if not data:
                open_fds.discard(fd)
                _write_all(log, lines[fd].rest())
                continue
            if target in live_targets and not _write_all(target, data):
                live_targets.discard(target)
            _write_all(log, lines[fd].feed(data))


def main(argv: list[str]) -> int:
    log_path, out_fd, err_fd = argv[0], int(argv[1]), int(argv[2])
    copy(log_path, {out_fd: 1, err_fd: 2})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
