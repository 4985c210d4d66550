"""After a restart, make the unchanged HF/TRL trainer resume from the newest checkpoint in its output_dir.

Both backends export TORCHELASTIC_RESTART_COUNT (torchrun adds DUALRUN_JOB_RESTARTS when dualrun restarted
the job with fresh servers); on a restart (> 0) `Trainer.train()` called without
`resume_from_checkpoint` gets the newest `checkpoint-*` folder, when one exists. A value the user passed wins.
"""
from __future__ import annotations

import os
import sys

from dualrun.rank.hooks import when_imported
from dualrun.contract.protocol import JOB_RESTARTS


def restart_count() -> int:
    """Restarts so far: torchrun's own (workers) plus dualrun's (the whole job, after a server died)."""
    total = 0
    for name in ("TORCHELASTIC_RESTART_COUNT", JOB_RESTARTS):
        try:
            total += int(os.environ.get(name, "0"))
        except ValueError:
            pass
    return total


def last_complete_checkpoint(output_dir: str) -> str | None:
    """The newest `checkpoint-N` that was written to the end (its trainer_state.json, written last, exists).

    A rank killed while rank 0 saved leaves a `checkpoint-N` folder without it; resuming from that one fails."""
    import re

    steps = []
    for name in os.listdir(output_dir):
        m = re.fullmatch(r"checkpoint-(\d+)", name)
        path = os.path.join(output_dir, name)
        if m and os.path.isfile(os.path.join(path, "trainer_state.json")):
            steps.append((int(m.group(1)), path))
    return max(steps)[1] if steps else None


def _patch(module) -> None:
    trainer_cls = getattr(module, "Trainer", None)
    if trainer_cls is None or getattr(trainer_cls.train, "_dualrun_resume", False):
        return
    original = trainer_cls.train

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if resume_from_checkpoint is None and restart_count() > 0:
            out = getattr(self.args, "output_dir", None)
            last = last_complete_checkpoint(out) if out and os.path.isdir(out) else None
            if last:
                if os.environ.get("RANK", "0") == "0":
                    print(f"[dualrun] restart {restart_count()}: resuming from {last}", file=sys.stderr, flush=True)
                resume_from_checkpoint = last
        return original(self, resume_from_checkpoint, *args, **kwargs)

    train._dualrun_resume = True  # type: ignore[attr-defined]
    trainer_cls.train = train


def _fresh_store_keys(module) -> None:
    """torchrun's static rendezvous keeps ONE agent TCPStore across restarts and workers use it without a
    per-attempt prefix (torch assumes a new store per retry), so a restarted rank can read the previous attempt's
    gloo/NCCL addresses and fail with "connection refused". Scope this attempt's keys by the restart count."""
    original = module._create_c10d_store
    if getattr(original, "_dualrun", False):
        return
    attempt = restart_count()

    def create(*args, **kwargs):
        from torch.distributed import PrefixStore

        return PrefixStore(f"dualrun/attempt_{attempt}", original(*args, **kwargs))

    create._dualrun = True  # type: ignore[attr-defined]
    module._create_c10d_store = create


def activate() -> None:
    if restart_count() > 0:
        when_imported("transformers.trainer", _patch)
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            when_imported("torch.distributed.rendezvous", _fresh_store_keys)
