"""What a vLLM CPU engine's first logprobs request would build, built once its worker has warmed its model, at the
lowest priority, in the vLLM servers dualrun starts.

Why: on vLLM's CPU build the first request that asks logprobs (TRL's every request; a teacher's top-k) compiles the
sampler's `batched_count_greater_than` with torch.compile, and inductor first probes which vector ISA the CPU has:
a test library per ISA, each loaded in a fresh interpreter (`pick_vec_isa`, 1.5 of that request's 2.2 s here). It
sat on the path from the server's health to the trainers' first step (benchmarks/results/startup_side_by_side.md):
between the two the trainers ask `/server_info` and form the weight-sync group, time in which the worker waits.
So the worker probes then, in a thread at nice 19 (the thread and the interpreters it starts: Linux nice is per
thread), taking CPU no one else wants; the result is inductor's own cache (`valid_vec_isa_list`), which the first
compile then reads. The modules it uses are the worker's already (vLLM's CPU worker imports them): the thread
imports nothing another thread could be importing.

Not warmed: `/server_info`'s system report (1.1 s on the same path, TRL's first call). vLLM builds it with
`importlib.util.find_spec("pip")`, which turns setuptools' distutils shim off for the process: built early, in the
API server, any later `import setuptools` there fails (an AssertionError in `_distutils_hack`).

A vLLM general plugin (entry point `vllm.general_plugins`), which vLLM calls in each of its processes: it acts only
in the workers (`VllmWorker-*`) of a vLLM CPU engine (the plan's `protocol.QUIET_READERS` mark) that dualrun started
(its env has the job's secret), and only where this vLLM's CPU worker has the model warm-up it follows.
"""
from __future__ import annotations

import importlib
import os
import threading
from typing import Callable, Mapping

from dualrun.contract.protocol import JOB_TOKEN, QUIET_READERS

VEC_ISA = ("torch._inductor.cpu_vec_isa", "pick_vec_isa")   # inductor's functools.cache'd ISA choice
WORKER_CLASS = ("vllm.v1.worker.cpu_worker", "CPUWorker")    # the probe starts after its compile_or_warm_up_model
WORKER_PREFIX = "VllmWorker"   # vLLM's multiprocessing name for a worker process
LOWEST = 19                    # nice: the lowest priority an unprivileged thread may take

_hooked = False


def wanted(env: Mapping[str, str], process_name: str) -> bool:
    """Pure: probe in this vLLM process? A worker of a vLLM CPU engine dualrun started."""
    return (process_name.startswith(WORKER_PREFIX) and env.get(QUIET_READERS) == "1" and bool(env.get(JOB_TOKEN)))


def warm(call: Callable[[], object] | tuple[str, str] = VEC_ISA) -> bool:
    """In the calling thread: take the lowest priority, make the call (a function, or a (module, function) the
    process has imported); whether it was made. Silent on failure: the first compile then probes, as before."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST)   # this thread only (Linux)
    except (AttributeError, OSError):
        pass
    try:
        if isinstance(call, tuple):
            call = getattr(importlib.import_module(call[0]), call[1])
        call()
        return True
    except Exception:  # noqa: BLE001 - another torch, a probe that fails: the first compile probes (or fails) itself
        return False


def start() -> None:
    """The probe, in a daemon thread."""
    threading.Thread(target=warm, name="dualrun-warm-vec-isa", daemon=True).start()


def after_model_warm_up(cls: type) -> bool:
    """Start the probe when the worker class `cls` has warmed its model; whether hooked (once per class)."""
    original = getattr(cls, "compile_or_warm_up_model", None)
    if original is None or getattr(original, "_dualrun_warm", False):
        return False

    def compile_or_warm_up_model(self, *args, **kwargs):  # noqa: ANN001, ANN202 - vLLM's signature
        result = original(self, *args, **kwargs)
        start()
        return result

    compile_or_warm_up_model._dualrun_warm = True  # type: ignore[attr-defined]
    cls.compile_or_warm_up_model = compile_or_warm_up_model
    return True


def apply(env: Mapping[str, str] = os.environ) -> bool:
    """vLLM plugin (vLLM may call it more than once per process): hook the CPU worker's model warm-up where `wanted`;
    whether it is hooked."""
    global _hooked
    import multiprocessing

    if _hooked or not wanted(env, multiprocessing.current_process().name):
        return _hooked
    try:
        cls = getattr(importlib.import_module(WORKER_CLASS[0]), WORKER_CLASS[1])
    except (ImportError, AttributeError):   # another vLLM: its first logprobs request probes, as before
        return False
    _hooked = after_model_warm_up(cls)
    return _hooked
