"""Defaults dualrun fills in every trainer config, whatever the method (only fields the user left alone).

DeepSpeed without a GPU: accelerate treats a process group with no backend name as "not distributed" and
counts one process, so HF computes DeepSpeed's batch size for one rank while DeepSpeed runs on all of them.
Naming the backend (`ddp_backend="gloo"`, what a CPU DeepSpeed run needs anyway) makes both agree.

`collective_timeout_s`: NCCL/gloo timeouts are a top complaint (a hung rank, or a slow first step, kills the
job after torch's default). One key sets TrainingArguments' `ddp_timeout` where left at its default and
torch.distributed's `init_process_group(timeout=...)` where the script passes none, on both backends.
"""
from __future__ import annotations

import functools
import os
from typing import Any

from dualrun.rank.hooks import when_imported


def _training_args_fields(cpu_deepspeed: bool, timeout_s: float | None) -> dict[str, Any]:
    values: dict[str, Any] = {}
    if cpu_deepspeed:
        import torch

        if not torch.cuda.is_available():
            values["ddp_backend"] = "gloo"
    if timeout_s:
        values["ddp_timeout"] = int(timeout_s)
    return values


def _patch_training_args(module, cpu_deepspeed: bool, timeout_s: float | None) -> None:
    from dualrun.rank.wiring import fill_defaults, say

    values = _training_args_fields(cpu_deepspeed, timeout_s)
    if values:
        fill_defaults(module.TrainingArguments, values, lambda cfg, filled: say(
            f"{type(cfg).__name__}: " + ", ".join(f"{k}={v!r}" for k, v in filled.items())))


def _patch_init_process_group(dist, timeout_s: float) -> None:
    """torch.distributed.init_process_group gets `timeout` when its caller passes none (3rd positional)."""
    import datetime

    c10d = dist.distributed_c10d
    original = c10d.init_process_group
    if getattr(original, "_dualrun_timeout", None) is not None:
        return

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if len(args) < 3 and kwargs.get("timeout") is None:
            kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
        return original(*args, **kwargs)

    init_process_group._dualrun_timeout = timeout_s  # type: ignore[attr-defined]
    c10d.init_process_group = init_process_group
    dist.init_process_group = init_process_group


def activate() -> None:
    from dualrun.rank.method import worker_settings

    timeout_s = worker_settings().get("collective_timeout_s")
    cpu_deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
    if cpu_deepspeed or timeout_s:
        when_imported("transformers.training_args", lambda m: _patch_training_args(m, cpu_deepspeed, timeout_s))
    if timeout_s:
        when_imported("torch.distributed", lambda m: _patch_init_process_group(m, float(timeout_s)))
