"""A server's trouble with its clients, reported one line per kind and at most once per interval.

Why: a router or an engine that any process on the machine can reach gets malformed requests and dropped
connections (a port scanner, a client killed mid-request, slowloris). The libraries print a traceback for each
(aiohttp's "Error handling request", socketserver's "Exception occurred during processing of request"); hundreds
of them bury the job's own lines and fill `log_dir`. Each kind (what happened, the exception's type) is said once,
then counted, and said again with its count at most once per `every_s` seconds. With `debug` (the servers pass
`DUALRUN_DEBUG=1` of their environment) the tracebacks are printed as well.
"""
from __future__ import annotations

import sys
import threading
import time
import traceback
from typing import Callable, TextIO

MALFORMED = "a malformed request"
DROPPED = "a dropped connection"
FAILED = "a request that failed"

# what a client that goes away mid-request makes a server's writes and reads raise
DROPPED_ERRORS = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError)

_DETAIL_CHARS = 160


def _shown(text: str) -> str:
    """A client-controlled text fit for one line: its whitespace runs one space, the rest escaped (no terminal
    control, no second line), cut short."""
    text = " ".join(text[:1000].split())
    text = "".join(c if " " <= c <= "~" else c.encode("unicode_escape").decode("ascii") for c in text)
    return text if len(text) <= _DETAIL_CHARS else text[: _DETAIL_CHARS - 3] + "..."


class Noise:
    """One line per (what, exception type); thread-safe (a threaded server reports from its handler threads)."""

    def __init__(self, prefix: str, every_s: float = 60.0, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic, debug: bool = False) -> None:
        self.prefix, self.every_s, self.clock = prefix, every_s, clock
        self.stream, self.debug = stream, debug
        self._lock = threading.Lock()
        self._kinds: dict[tuple[str, str], list[float]] = {}   # kind -> [when last said, count since]

    def report(self, what: str, error: BaseException | str, detail: str = "") -> None:
        """One occurrence of `what` (MALFORMED, DROPPED, FAILED) caused by `error` (an exception or its type's
        name); `detail` (the client's address, the request line) is shown escaped and cut."""
        name = error if isinstance(error, str) else type(error).__name__
        message = "" if isinstance(error, str) else str(error)
        shown = _shown(": ".join(p for p in (message, detail) if p))
        now = self.clock()
        with self._lock:
            state = self._kinds.get((what, name))
            if state is None:
                self._kinds[(what, name)] = [now, 0]
                line = (f"{what} ({name}{': ' + shown if shown else ''}); more of this kind are counted and reported "
                        f"at most once per {self.every_s:g} s")
            else:
                state[1] += 1
                if now - state[0] < self.every_s:
                    line = None
                else:
                    line = f"{what} ({name}): {state[1]} more in the last {now - state[0]:.0f} s" + (
                        f"; the latest: {shown}" if shown else "")
                    state[0], state[1] = now, 0
        if line is not None:
            self._write(f"{self.prefix}: {line}\n")
        if self.debug and not isinstance(error, str):
            self._write("".join(traceback.format_exception(type(error), error, error.__traceback__)))

    def _write(self, text: str) -> None:
        stream = self.stream or sys.stderr
        try:
            stream.write(text)
            stream.flush()
        except (ValueError, OSError):
            pass
