"""The long-poll that carries a Ray actor's output lines to the driver (dualrun/light/line_queue.py): batches, the wait
for the first line, and the end mark that every later call sees."""
from __future__ import annotations

import threading
import time

from dualrun.light.line_queue import STDERR, STDOUT, LineQueue


def test_lines_come_in_one_batch_then_the_end_for_every_later_call():
    q = LineQueue()
    q.put(STDOUT, "step 1")
    q.put(STDERR, "warning")
    assert q.take(timeout=1) == [(STDOUT, "step 1"), (STDERR, "warning")]
    q.put(STDOUT, "last")
    q.close()
    assert q.take(timeout=1) == [(STDOUT, "last")]   # the lines before the end, then the end
    assert q.take(timeout=1) is None
    assert q.take(timeout=1) is None


def test_an_empty_wait_answers_an_empty_batch_and_a_late_line_ends_the_wait():
    q = LineQueue()
    t0 = time.monotonic()
    assert q.take(timeout=0.2) == []
    assert time.monotonic() - t0 >= 0.2
    threading.Timer(0.3, q.put, (STDOUT, "late")).start()
    t0 = time.monotonic()
    assert q.take(timeout=5) == [(STDOUT, "late")]
    assert time.monotonic() - t0 < 3


def test_a_backlog_of_a_full_batch_is_answered_without_the_linger():
    """A rank that prints faster than batches go is not held to one batch per LINGER_S."""
    from dualrun.light.line_queue import BATCH, LINGER_S

    q = LineQueue()
    for i in range(3 * BATCH):
        q.put(STDOUT, f"line {i}")
    t0 = time.monotonic()
    got = [q.take(timeout=1) for _ in range(2)]
    assert [len(b) for b in got] == [BATCH, BATCH]
    assert time.monotonic() - t0 < LINGER_S   # neither call lingered
