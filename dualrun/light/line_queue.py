"""Output lines handed from a Ray actor to the driver by long-poll: the actor puts each line of its process's output
on a LineQueue; the driver calls the actor's `lines()` (`LineQueue.take`) in a loop and prints each batch itself.

Why a long-poll and not Ray's log forwarding: the driver prints whole lines with its own `[label]` prefix, without
Ray's prefixes, and there is one remote call per burst of output, not per line. Why the burst gathers for
`LINGER_S` before the batch is answered (a sleep, not a wait per line): a trainer logging every step writes ~50 lines a
second; waking the taking thread for each cost a rank's actor ~0.01 cores, the batch costs one wake-up. A line reaches
the driver's console at most ~LINGER_S late; the end of output cuts the linger short. Used by the rank actors
(backends/ray/actors/rank_actor.py) and the server actors (backends/ray/actor_servers.py); standard library only, as
both are imported by Ray worker processes.
"""
from __future__ import annotations

import queue
import threading

STDOUT, STDERR = 1, 2
LINGER_S = 0.5      # after the first line, how long the burst gathers before the batch is answered
BATCH = 2000        # most lines handed over per call


class LineQueue:
    """Lines of one process's output, `(stream, text)`, then an end mark once it can write no more."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._closed = threading.Event()

    def put(self, stream: int, text: str) -> None:
        self._queue.put((stream, text))

    def close(self) -> None:
        """No more output (the process ended and its pipes are read): `take` answers None from now on."""
        self._queue.put(None)
        self._closed.set()

    def take(self, timeout: float = 5.0) -> list[tuple[int, str]] | None:
        """Long-poll: the queued lines (waits up to `timeout` for the first; [] if none came); None once closed."""
        out: list[tuple[int, str]] = []
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return out
        if item is not None and self._queue.qsize() < BATCH - 1:   # a full batch waiting goes at once
            self._closed.wait(LINGER_S)   # the burst gathers (one wake-up per batch), cut short by the end
        while True:
            if item is None:
                self._queue.put(None)   # every later call (and the next one, after these lines) sees the end too
                return out or None
            out.append(item)
            if len(out) >= BATCH:
                return out
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return out
