"""The Ray servers' output on the driver's stderr, as it comes: under torchrun each server's own tee prints it; on
Ray the server runs in an actor, which keeps its lines until the driver asks (`ServerActor.lines`)."""
from __future__ import annotations

import queue
import sys
import threading
import time
from typing import Any, Callable


def print_output(actors: list[Any], stopping: Callable[[], bool], printed: threading.Event,
                 fresh: "queue.Queue[Any]") -> threading.Thread:
    """A started thread that prints every actor's lines until each has ended and `stopping()`, or `printed` is set
    (the set is done waiting); an actor put on `fresh` (a restarted replica's) joins it."""
    import ray
    from ray.exceptions import RayError

    stream = sys.stderr

    def run() -> None:
        pending = {a.lines.remote(): a for a in actors}
        while (pending or not stopping()) and not printed.is_set():
            while not fresh.empty():
                actor = fresh.get()
                pending[actor.lines.remote()] = actor
            if not pending:
                time.sleep(0.25)
                continue
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
            for ref in ready:
                actor = pending.pop(ref)
                try:
                    batch = ray.get(ref)
                except RayError:   # the actor is gone (stopped, replaced, or died: the watch names it)
                    continue
                if batch is None:
                    continue
                if batch:
                    stream.write("".join(text + "\n" for _, text in batch))
                    stream.flush()
                pending[actor.lines.remote()] = actor

    thread = threading.Thread(target=run, name="dualrun-server-output", daemon=True)
    thread.start()
    return thread
