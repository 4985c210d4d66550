"""A Ray rank's actor reading its program's output (dualrun/backends/ray/actors/rank_actor.py, the class itself, without Ray):
a trainer that logs every step is read in a few batches, not a wake-up per line (a wake-up per line costs ~0.01 cores
of a rank's actor), and a program that writes fast is not held up by the pauses between reads."""
from __future__ import annotations

import sys
import threading
import time

from dualrun.backends.ray.actors import rank_actor
from dualrun.backends.ray.actors.rank_actor import RankWorker

_EVERY_20_MS = "import time\nfor i in range(50):\n    print(f'step {i}', flush=True)\n    time.sleep(0.02)\n"
_FOUR_MIB = "import sys\nsys.stdout.write(('x' * 1023 + '\\n') * 4096)\nsys.stdout.flush()\n"


def _run(tmp_path, code: str) -> tuple[list[list[str]], float, float]:
    """The batches the driver's long-poll gets while the program runs, the program's run time, and how long after
    the program's exit the output ended (the long-poll's end mark)."""
    worker = RankWorker("dualrun-test-rank-output", "rank 0")
    t0 = time.time()   # worker.end is a time.time()
    worker.start([sys.executable, "-c", code], {"PATH": "/usr/bin:/bin"}, str(tmp_path))
    codes: list[int] = []
    waiter = threading.Thread(target=lambda: codes.append(worker.wait().exit_code))   # closes the queue at the end
    waiter.start()
    batches: list[list[str]] = []
    while (batch := worker.queue.take(5.0)) is not None:
        if batch:
            batches.append([t for _, t in batch])
    lag = time.time() - worker.end
    waiter.join(10)
    assert codes == [0]
    return batches, worker.end - t0, lag


def test_a_line_every_20_ms_is_read_and_handed_over_in_a_few_batches_in_order(tmp_path, monkeypatch):
    reads: list[int] = []

    class Counting(rank_actor.Collapser):   # the reader feeds it once per read of the pipe
        def feed(self, text, raw=None):
            reads.append(len(text))
            return super().feed(text, raw)

    monkeypatch.setattr(rank_actor, "Collapser", Counting)
    batches, _, _ = _run(tmp_path, _EVERY_20_MS)
    lines = [t for b in batches for t in b]
    assert lines == [f"step {i}" for i in range(50)]
    # ~1 s of output: a read per READ_PAUSE_S (0.25 s), not one per line; a batch per LINGER_S (0.5 s)
    assert len([n for n in reads if n]) <= 16, reads
    assert len(batches) <= 3, [len(b) for b in batches]


def test_four_mib_written_at_once_is_read_without_waiting_on_the_pauses(tmp_path):
    batches, took, _ = _run(tmp_path, _FOUR_MIB)
    assert sum(len(b) for b in batches) == 4096
    assert took < 3.0, took   # 64 KiB reads with a 0.25 s pause each would hold the writer ~16 s


def test_the_output_ends_as_soon_as_the_program_exits(tmp_path):
    """The pause between reads does not hold the end of a rank's output (the job's end) back."""
    _, _, lag = _run(tmp_path, "import time; print('x', flush=True); time.sleep(0.05)")
    assert lag < 0.15, lag   # the reader was mid-pause (READ_PAUSE_S, 0.25 s) when the program exited


def test_a_line_reaches_the_driver_within_a_read_pause_and_a_linger(tmp_path):
    """The docs' bound: a line shows up at most ~0.75 s (READ_PAUSE_S + LINGER_S) after the rank wrote it, while
    the rank goes on running (no end of output to cut the waits short)."""
    worker = RankWorker("dualrun-test-rank-output", "rank 0")
    worker.start([sys.executable, "-c", "import time; time.sleep(0.3); print(time.time(), flush=True); "
                  "time.sleep(3)"], {"PATH": "/usr/bin:/bin"}, str(tmp_path))
    try:
        while not (batch := worker.queue.take(5.0)):
            pass
        late = time.time() - float(batch[0][1])
    finally:
        worker.stop(grace=1.0)
        worker.wait()
    assert late < 0.75 + 0.25, late   # the README's and concepts.md's 0.75 s, with 0.25 s of slack for a busy machine
