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
