"""(helper of weight_sync_bench.py) Where a vLLM worker spends a weight update: loaded into the worker as
`--worker-extension-cls benchlib.weight_sync_timing.TimingExtension` (benchmarks/ on the server's PYTHONPATH).

Why an extension and not a hook in the engine: the benchmark must time the engine as users run it. vLLM imports the
extension's module in each worker before any update, so wrapping `GlooWeightTransferEngine`'s methods here times
them without changing dualrun's code. Each call prints one line to stderr (the server's log):

    dualrun-bench-timing {"phase": "update", "s": ..., "recv_s": ..., "load_s": ..., "wait_s": ..., "bytes": ...}

From the engine's receiver (`dualrun.weightsync.stream.Receiver.stats`): `recv_s`: its relay thread waiting for
segments from the rank before (the transfer, and the trainer's packing; it overlaps `load_s`); `load_s`: unpacking
(views) and vLLM's `model.load_weights` (layerwise reload) of the chunks; `wait_s`: waiting for the segments passed
on to the next rank to leave. `s` is the whole update. `start`/`finish` time vLLM's `initialize_layerwise_reload` /
`finalize_layerwise_reload` (+ the tied-head repack).
"""
from __future__ import annotations

import functools
import json
import sys
import time
from typing import Callable

try:
    from dualrun.weightsync.engine import transfer as gloo_transfer
except ImportError:   # no vLLM here (weight_sync_bench.py reads MARK to parse the logs): nothing to time
    gloo_transfer = None

MARK = "dualrun-bench-timing"


def _say(record: dict) -> None:
    print(f"{MARK} {json.dumps(record)}", file=sys.stderr, flush=True)


def _timed_update(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def receive_weights(self, update_info):  # noqa: ANN001 - the engine's signature
        t0 = time.perf_counter()
        try:
            return orig(self, update_info)
        finally:
            stats = dict(self.receiver.stats) if self.receiver is not None else {}
            _say({"phase": "update", "s": time.perf_counter() - t0, **stats})
    return receive_weights


def _timed_phase(orig: Callable, phase: str) -> Callable:
    @functools.wraps(orig)
    def wrapper(self):  # noqa: ANN001
        t0 = time.perf_counter()
        try:
            return orig(self)
        finally:
            _say({"phase": phase, "s": time.perf_counter() - t0})
    return wrapper


_engine = gloo_transfer.GlooWeightTransferEngine if gloo_transfer else None
if _engine is not None and not hasattr(_engine.receive_weights, "__wrapped__"):   # once (functools.wraps marks it)
    _engine.receive_weights = _timed_update(_engine.receive_weights)
    _engine.start_weight_update = _timed_phase(_engine.start_weight_update, "start")
    _engine.finish_weight_update = _timed_phase(_engine.finish_weight_update, "finish")


class TimingExtension:
    """Adds nothing to the worker: importing this module is the point."""
