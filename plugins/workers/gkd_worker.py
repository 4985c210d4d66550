"""gkd's worker half: the hooks every trainer rank installs before the user's script (the driver half is
plugins/gkd.py).

A separate teacher: the unchanged GKDTrainer gets, instead of loading its teacher, a stand-in that asks the teacher
server (`dualrun.rank.teacher.RemoteTeacher`) and a `compute_loss` that takes GKD's loss from the top-k answer
without a vocabulary-sized teacher tensor (`dualrun.rank.topk_loss`); ServerDistillationConfig gets
`teacher_model_server_url`. A separate `rollout` points DistillationConfig's vLLM server mode at its server, as for
GRPO (TRL's DistillationTrainer reads it); GKDTrainer generates with the student itself, so with a rollout server
it stops at construction with one line.
"""
from __future__ import annotations

import functools
import inspect
import os
from typing import Any, Mapping

from dualrun.plugins.workers.grpo_worker import seed_rollout, wire_rollout
from dualrun.contract.protocol import ROLLOUT_ADDRESS, TEACHER_ADDRESS
from dualrun.weightsync.trainer.vllm_client import install as install_gloo_client
from dualrun.rank.hooks import when_imported
from dualrun.rank.wiring import fill_defaults, say

FULL_VOCAB_HINT = ("a teacher server returns only the top-k log-probabilities of each token; for full-vocabulary "
                   "distillation colocate the teacher with the trainer: colocate_groups: [[train, teacher]]")


def activate(settings: Mapping[str, Any]) -> None:
    """A separate teacher: GKDTrainer asks its server (top-k); a colocated one with `top_k`: the same top-k
    distribution; a rollout server: DistillationConfig's server mode, and GKDTrainer refused."""
    teacher = (settings.get("roles") or {}).get("teacher") or {}
    top_k = int(teacher.get("top_k") or 0)
    address = os.environ.get(TEACHER_ADDRESS)
    if teacher.get("separate") and address:
        when_imported("trl.experimental.gkd.gkd_trainer",
                      lambda m: serve_gkd_teacher(m.GKDTrainer, address, top_k, teacher.get("model")))
        when_imported("trl.trainer.distillation_config", lambda m: fill_defaults(
            m.DistillationConfig, lambda c: _server_distillation_fields(c, address, top_k)))
    elif teacher and top_k:
        when_imported("trl.experimental.gkd.gkd_trainer", lambda m: truncate_gkd_teacher(m.GKDTrainer, top_k))
    if teacher and not teacher.get("separate") and teacher.get("model"):
        # a colocated teacher named in the config: GKDConfig loads it, unless the script names its own
        when_imported("trl.experimental.gkd.gkd_config", lambda m: fill_defaults(
            m.GKDConfig, {"teacher_model_name_or_path": teacher["model"]},
            lambda cfg, filled: say(f"GKDConfig: {filled} (roles.teacher.model)")))
    rollout = os.environ.get(ROLLOUT_ADDRESS)
    if rollout:
        when_imported("trl.trainer.distillation_config", lambda m: wire_rollout(m, "DistillationConfig", rollout))
        when_imported("trl.generation.vllm_client", install_gloo_client)   # weight sync to a CPU vLLM rollout
        when_imported("trl.generation.vllm_client", seed_rollout)          # the same completions run after run
        when_imported("trl.experimental.gkd.gkd_trainer", lambda m: refuse_rollout_server(m.GKDTrainer))


def _server_distillation_fields(config: Any, address: str, top_k: int) -> dict[str, Any]:
    """ServerDistillationConfig: the teacher server's URL, and the role's top-k where TRL allows it (beta == 0)."""
    if not hasattr(config, "teacher_model_server_url"):
        return {}
    fields: dict[str, Any] = {"teacher_model_server_url": f"http://{address}"}
    if getattr(config, "beta", None) == 0 and top_k:
        fields["loss_top_k"] = top_k
    return fields


def _teacher_config(teacher: Any, model: Any, role_model: str | None) -> Any:
    """The teacher's model config (its vocabulary size is all GKD reads), without loading any weights."""
    from transformers import AutoConfig

    if getattr(teacher, "config", None) is not None:
        return teacher.config
    for source in (teacher, role_model, model):
        if isinstance(source, str):
            try:
                return AutoConfig.from_pretrained(source)
            except (OSError, ValueError):
                continue
    return model.config


def serve_gkd_teacher(cls: type, address: str, top_k: int, role_model: str | None) -> None:
    """GKDTrainer gets a RemoteTeacher instead of loading (or using) its own teacher model, and the top-k loss."""
    from dualrun.rank.teacher import RemoteTeacher, use_topk_loss

    if getattr(cls.__init__, "_dualrun", False):
        return
    use_topk_loss(cls)
    init = cls.__init__
    signature = inspect.signature(init)

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        config = bound.arguments.get("args")
        if getattr(config, "seq_kd", False):
            raise ValueError("GKDConfig.seq_kd=True generates with the teacher, but roles.teacher is a separate "
                             "server that returns top-k log-probabilities only; " + FULL_VOCAB_HINT.split("; ")[1])
        if config is not None and getattr(config, "teacher_model_init_kwargs", None) is not None:
            config.teacher_model_init_kwargs = None  # nothing is loaded here: the teacher role loads it
        teacher = bound.arguments.get("teacher_model")
        bound.arguments["teacher_model"] = RemoteTeacher(address, top_k,
                                                         _teacher_config(teacher, bound.arguments.get("model"),
                                                                         role_model))
        say(f"GKD teacher served by the teacher role at {address} (top-{top_k} log-probabilities)")
        init(*bound.args, **bound.kwargs)

    __init__._dualrun = True  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[method-assign]


ROLLOUT_UNREAD = ("roles.rollout is a separate vLLM server, but GKDTrainer generates with the student itself and "
                  "never reads it: remove roles.rollout, or train with TRL's DistillationTrainer, "
                  "whose DistillationConfig dualrun points at the server")


def refuse_rollout_server(cls: type) -> None:
    """A rollout server GKDTrainer would never ask: stop at the trainer's construction, with what to do instead."""
    init = cls.__init__
    if getattr(init, "_dualrun_rollout", False):
        return

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        raise ValueError(ROLLOUT_UNREAD)

    __init__._dualrun_rollout = True  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[method-assign]


def truncate_gkd_teacher(cls: type, top_k: int) -> None:
    """A colocated teacher with `top_k`: GKD distils the same top-k distribution a teacher server would give."""
    from dualrun.rank.teacher import TruncatedTeacher

    if getattr(cls.__init__, "_dualrun", False):
        return
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.teacher_model = TruncatedTeacher(self.teacher_model, top_k)

    __init__._dualrun = True  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[method-assign]
