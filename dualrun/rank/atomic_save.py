"""Checkpoints written whole or not at all: a rank stopped during the Trainer's save leaves no half-written
`checkpoint-N`.

Why: transformers' Trainer writes `output_dir/checkpoint-N` in place (weights, optimizer, each rank's RNG state,
`trainer_state.json` last). A rank stopped meanwhile (SIGTERM from torchrun or the machine watch when another machine
is lost, SIGKILL) leaves a partial folder that looks like a checkpoint. Here, for every Trainer of a dualrun job (the
unchanged script's), `_save_checkpoint` writes into a sibling `tmp-checkpoint-N/checkpoint-N` instead (its
`_get_output_dir` points there for the call), then, once every rank has written its part (a barrier), one process
per file system renames the folder to `checkpoint-N` and the ranks meet again. Every save path of the Trainer
(plain and DDP, FSDP full or sharded, DeepSpeed) writes below the folder it is given, so each is covered. A save
with `push_to_hub` (whose uploads read the folder in the background) stays in place, as transformers writes it.

Leftovers of a killed save (`tmp-checkpoint-*`) never match `checkpoint-*`: neither transformers'
`get_last_checkpoint`, its rotation, nor dualrun's resume (rank/resume.py) takes them; the next save removes them.
"""
from __future__ import annotations

import os
import shutil
import uuid
from typing import Any

from dualrun.rank.hooks import when_imported

STAGING = "tmp-"   # prefix of a checkpoint folder being written: tmp-checkpoint-N


def activate() -> None:
    when_imported("transformers.trainer", _patch)


def set_aside(staging: str) -> None:
    """A staging folder left by a killed save of the same step: moved out of the way (removed after the next
    publish), so that this save writes into an empty one."""
    try:
        os.rename(staging, f"{staging}.stale-{uuid.uuid4().hex[:8]}")
    except FileNotFoundError:
        pass   # another rank on the same file system moved it


def publish(staging: str, name: str, run_dir: str) -> bool:
    """Move `staging/name` (complete: every rank has written its part) to `run_dir/name`, and remove every other
    staging leftover of `run_dir`. Exactly one caller per file system does it (the one whose claim, a rename of
    `staging`, succeeds) and gets True; the others (it was published already, or nothing was written here) False.
    A `run_dir/name` already there (the same step saved again) is replaced."""
    claim = f"{staging}.{uuid.uuid4().hex[:8]}"
    try:
        os.rename(staging, claim)
    except FileNotFoundError:
        return False
    final = os.path.join(run_dir, name)
    if os.path.lexists(final):
        os.rename(final, f"{claim}.replaced")
    os.rename(os.path.join(claim, name), final)
    for entry in os.listdir(run_dir):
        if entry.startswith(STAGING + name.rsplit("-", 1)[0] + "-"):
            shutil.rmtree(os.path.join(run_dir, entry), ignore_errors=True)
    return True


def _save_atomically(trainer: Any, save: Any, prefix: str, model: Any, trial: Any, *args: Any, **kwargs: Any) -> None:
    """`save` (the trainer's own `_save_checkpoint`) into a staging folder, then published whole."""
    if getattr(trainer.args, "push_to_hub", False):
        return save(model, trial, *args, **kwargs)
    run_dir = trainer._get_output_dir(trial=trial)
    name = f"{prefix}-{trainer.state.global_step}"
    staging = os.path.join(run_dir, STAGING + name)
    if os.path.isdir(staging):
        set_aside(staging)
    trainer.accelerator.wait_for_everyone()   # no rank writes before a stale staging folder is gone
    trainer._get_output_dir = lambda trial=None: staging
    try:
        save(model, trial, *args, **kwargs)
    finally:
        del trainer._get_output_dir
    written = os.path.join(staging, name)
    if trainer.state.best_model_checkpoint == written:   # this step is the best: its published path
        trainer.state.best_model_checkpoint = os.path.join(run_dir, name)
        if trainer.args.should_save:
            trainer.state.save_to_json(os.path.join(written, "trainer_state.json"))
    trainer.accelerator.wait_for_everyone()   # every rank's files are in the staging folder
    publish(staging, name, run_dir)
    trainer.accelerator.wait_for_everyone()   # checkpoint-N exists for every rank once the save returns


def _patch(module: Any) -> None:
    trainer_cls = getattr(module, "Trainer", None)
    if trainer_cls is None or getattr(trainer_cls.__init__, "_dualrun_atomic", False):
        return
    original = trainer_cls.__init__
    prefix = getattr(module, "PREFIX_CHECKPOINT_DIR", "checkpoint")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if "_save_checkpoint" not in vars(self):   # the outermost save (a subclass's override included) is wrapped
            save = self._save_checkpoint
            self._save_checkpoint = lambda model, trial, *a, **kw: _save_atomically(self, save, prefix, model, trial,
                                                                                     *a, **kw)

    __init__._dualrun_atomic = True  # type: ignore[attr-defined]
    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    trainer_cls.__init__ = __init__
