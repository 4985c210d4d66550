"""(helper of weight_sync_bench.py) Where a vLLM worker spends a weight update: loaded into the worker as
`--worker-extension-cls weight_sync_timing.TimingExtension` (benchmarks/ on the server's PYTHONPATH).

Why an extension and not a hook in the engine: the benchmark must time the engine as users run it. vLLM imports the
extension's module in each worker before any update, so wrapping `GlooWeightTransferEngine`'s methods here times
them without changing dualrun's code. Each call prints one line to stderr (the server's log):

    dualrun-bench-timing {"phase": "update", "s": ..., "recv_s": ..., "load_s": ..., "chunks": ..., "bytes": ...}

`recv_s`: waiting in the group's broadcast (the transfer, and the trainer's packing of that chunk); `load_s`: vLLM's
`model.load_weights` (layerwise reload) of the chunks; the rest of `s` is unpacking. `start`/`finish` time vLLM's
`initialize_layerwise_reload` / `finalize_layerwise_reload` (+ the tied-head repack).
"""
from __future__ import annotations

import functools
import json
import sys
import time
from typing import Any, Callable

try:
    from dualrun.weightsync.engine import transfer as gloo_transfer
except ImportError:   # no vLLM here (weight_sync_bench.py reads MARK to parse the logs): nothing to time
    gloo_transfer = None

MARK = "dualrun-bench-timing"


def _say(record: dict) -> None:
    print(f"{MARK} {json.dumps(record)}", file=sys.stderr, flush=True)


class _TimedWork:
    def __init__(self, work: Any, stats: dict, t0: float) -> None:
        self.work, self.stats, self.t0 = work, stats, t0

    def wait(self, *args: Any) -> Any:
        out = self.work.wait(*args)
        self.stats["recv_s"] += time.perf_counter() - self.t0
        return out


class _TimedGroup:
    """The engine's group, whose broadcasts are timed from the call to the end of `wait()`."""

    def __init__(self, group: Any, stats: dict) -> None:
        self.group, self.stats = group, stats

    def broadcast(self, tensor: Any, src: int) -> _TimedWork:
        self.stats["chunks"] += 1
        self.stats["bytes"] += tensor.numel() * tensor.element_size()
        return _TimedWork(self.group.broadcast(tensor, src), self.stats, time.perf_counter())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.group, name)


def _timed_update(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def receive_weights(self, update_info):  # noqa: ANN001 - the engine's signature
        stats = {"phase": "update", "recv_s": 0.0, "load_s": 0.0, "chunks": 0, "bytes": 0}
        group, model = self.group, self.model
        load = model.load_weights

        def timed_load(weights):  # noqa: ANN001
            t = time.perf_counter()
            try:
                return load(weights)
            finally:
                stats["load_s"] += time.perf_counter() - t

        self.group = _TimedGroup(group, stats)
        object.__setattr__(model, "load_weights", timed_load)   # this call only; removed below
        t0 = time.perf_counter()
        try:
            return orig(self, update_info)
        finally:
            stats["s"] = time.perf_counter() - t0
            self.group = group
            object.__delattr__(model, "load_weights")
            _say(stats)
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
