"""Defaults dualrun fills in every trainer config, whatever the method (only fields the user left alone).

DeepSpeed without a GPU: accelerate treats a process group with no backend name as "not distributed" and
counts one process, so HF computes DeepSpeed's batch size for one rank while DeepSpeed runs on all of them.
Naming the backend (`ddp_backend="gloo"`, what a CPU DeepSpeed run needs anyway) makes both agree.
"""
from __future__ import annotations

import os

from dualrun.hooks import when_imported


def _patch(module) -> None:
    import torch

    from dualrun.servers.wiring import fill_defaults, say

    if torch.cuda.is_available():
        return
    fill_defaults(module.TrainingArguments, {"ddp_backend": "gloo"},
                  lambda cfg, filled: say(f"DeepSpeed on CPU: {type(cfg).__name__}.ddp_backend='gloo'"))


def activate() -> None:
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        when_imported("transformers.training_args", _patch)
