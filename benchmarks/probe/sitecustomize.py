"""Benchmark probe: worker-side timestamps of every phase, loaded by Python itself at start-up (`sitecustomize`).

Why here and not in dualrun: the benchmark compares dualrun against launchers that know nothing of it, so the
same probe must run in every worker without changing the script or the entry point. The benchmark puts this
folder first on PYTHONPATH (every launcher forwards PYTHONPATH) and sets DUALRUN_BENCH_PHASES=DIR; the probe
then activates only in processes that have RANK set at start (torchrun's and dualrun's workers; the Ray Train
driver activates it in its train loop with `activate()`), so drivers, agents and Ray daemons are untouched.

What it writes, one JSON file per rank (DIR/rank-R-PID.json), all times from `time.time()` (one clock for the
whole machine, so they line up with the driver's spawn time):
  started     the process's start time (/proc/self/stat; 10 ms resolution)
  probe       this module ran (interpreter initialised)
  torch       `import torch` finished
  rendezvous  `torch.distributed.init_process_group` returned
  steps       per optimizer step: wall time and this process's CPU time (time.process_time) at `on_step_end`
  train_end   `on_train_end`
  threads     torch.get_num_threads(), interop threads, OMP/MKL variables, CPU affinity — at the first step
  entry       sys.argv[0] and whether dualrun's bootstrap is loaded

Cost: one callback per step (two clock reads and a list append); the file is written at train end. The import
hooks are dualrun.rank.hooks' (a tiny module, no torch): a bare torchrun worker gets the same finder as a dualrun one.
"""
from __future__ import annotations

import json
import os
import sys
import time

from dualrun_bench_clock import process_start as _process_start   # this folder, on PYTHONPATH with this module

_DIR_ENV = "DUALRUN_BENCH_PHASES"
_record: dict = {}




def _write() -> None:
    folder = os.environ.get(_DIR_ENV)
    if not folder:
        return
    path = os.path.join(folder, f"rank-{_record.get('rank', 'x')}-{os.getpid()}.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_record, f)
    os.replace(tmp, path)


def _on_torch(module) -> None:
    _record["torch"] = time.time()


def _on_c10d(module) -> None:
    import functools

    original = module.init_process_group

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        _record["rendezvous_start"] = time.time()
        try:
            return original(*args, **kwargs)
        finally:
            _record["rendezvous"] = time.time()

    module.init_process_group = init_process_group
    dist = sys.modules.get("torch.distributed")
    if dist is not None and getattr(dist, "init_process_group", None) is original:
        dist.init_process_group = init_process_group


def _threads() -> dict:
    import torch

    return {"torch": torch.get_num_threads(), "interop": torch.get_num_interop_threads(),
            "env": {k: v for k, v in os.environ.items() if k.split("_")[0] in ("OMP", "MKL", "KMP", "OPENBLAS")},
            "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None}


def _on_trainer(module) -> None:
    from transformers import TrainerCallback

    steps: list = []
    _record["steps"] = steps

    class Probe(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            _record["train_begin"] = time.time()
            _record["threads"] = _threads()

        def on_step_end(self, args, state, control, **kw):
            steps.append((time.time(), time.process_time()))

        def on_train_end(self, args, state, control, **kw):
            _record["train_end"] = time.time()
            _write()

    original = module.Trainer.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.add_callback(Probe())

    module.Trainer.__init__ = __init__


def activate() -> None:
    """Start recording in this process (sitecustomize does it for workers; Ray Train's loop calls it)."""
    if _record.get("active") or not os.environ.get(_DIR_ENV):
        return
    _record.update(active=True, rank=os.environ.get("RANK", "0"), pid=os.getpid(), started=_process_start(),
                   probe=time.time(), argv0=sys.argv[0] if sys.argv else None)
    _record["env"] = dict(os.environ)   # the benchmark diffs launchers' worker env (temp files only)
    _record["bootstrap"] = "dualrun.rank.bootstrap" in sys.modules or any("dualrun" in a for a in sys.argv[:2])
    from dualrun.rank.hooks import when_imported   # a tiny module (the package import is lazy); no torch

    for name, fn in (("torch", _on_torch), ("torch.distributed.distributed_c10d", _on_c10d),
                     ("transformers.trainer", _on_trainer)):
        when_imported(name, fn)
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        _record["rendezvous"] = time.time()   # set up before the probe ran (Ray Train does it before the loop)
        _record["rendezvous_before_probe"] = True


# -- the launcher's side: where its seconds go before the ranks start ----------------------------------------------
# In a process without RANK (a launcher, a Ray actor), the probe records, once `dualrun.cli` is imported, when each
# of the driver's steps began and ended (DIR/driver-PID.json); in a Ray actor of dualrun's (an embedded cluster's
# workers inherit the driver's env), when its process started and when the rank actor was made (DIR/actor-PID.json).
# Wrapping, not editing dualrun: the same probe measures every revision.
_DRIVER_STEPS = (  # (module, attribute path, step name): the step's start and end are recorded
    ("dualrun.api", "run_job", "run_job"),
    ("dualrun.launchers.accelerate_env", "cached_accelerate_env", "accelerate_env"),
    ("dualrun.backends.ray.connect", "connect", "ray_connect"),
    ("dualrun.launchers.launcher", "Launcher.launch", "launch"),
    ("dualrun.backends.ray.actor_launcher", "RayLauncher.place_ranks", "place"),
    ("dualrun.backends.ray.actor_launcher", "RayLauncher.start_ranks", "start"),
    ("torch.distributed.run", "run", "agent"),
    ("dualrun.backends.ray.connect", "Connection.close", "ray_shutdown"),
)
_side: dict = {}


def _write_side(kind: str) -> None:
    folder = os.environ.get(_DIR_ENV)
    if folder and _side:
        with open(os.path.join(folder, f"{kind}-{os.getpid()}.json"), "w") as f:
            json.dump(_side, f)


def _wrap(owner, attr: str, step: str) -> None:
    import functools

    original = getattr(owner, attr)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        _side.setdefault(step + "_start", time.time())
        try:
            return original(*args, **kwargs)
        finally:
            _side[step + "_end"] = time.time()

    setattr(owner, attr, wrapper)


def _step_hook(path: str, step: str):
    def hook(module) -> None:
        owner = module
        *parents, attr = path.split(".")
        for name in parents:
            owner = getattr(owner, name)
        _wrap(owner, attr, step)
    return hook


def _on_cli(module) -> None:
    import atexit

    _side.update(started=_process_start(), probe=_record.get("side_probe"), cli_imported=time.time())
    for name, fn in (("torch", lambda m: _side.setdefault("torch_imported", time.time())),
                     ("ray", lambda m: _side.setdefault("ray_imported", time.time()))):
        when_imported(name, fn)
    for mod, path, step in _DRIVER_STEPS:
        when_imported(mod, _step_hook(path, step))
    atexit.register(_write_side, "driver")


def _on_rank_worker(module) -> None:
    if "dualrun.cli" in sys.modules:   # the driver imports it too: only actors record
        return
    original = module.RankWorker.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _side.update(started=_process_start(), probe=_record.get("side_probe"), actor_made=time.time())
        _write_side("actor")

    module.RankWorker.__init__ = __init__


if os.environ.get(_DIR_ENV) and os.environ.get("RANK") is not None:
    activate()
elif os.environ.get(_DIR_ENV):
    from dualrun.rank.hooks import when_imported

    _record["side_probe"] = time.time()
    when_imported("dualrun.cli", _on_cli)
    when_imported("dualrun.backends.ray.actors.rank_actor", _on_rank_worker)
