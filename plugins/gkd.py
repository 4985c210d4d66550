"""gkd's driver half: roles `train`, `teacher` and optional `rollout`.

A colocated teacher lives in the trainer processes and supports full-vocabulary distillation (no `top_k`) or
top-k (`top_k: K`). A separate teacher is served on its own GPUs (vLLM; the transformers CPU engine where there
are none) and is top-k only: the server returns the top-k log-probabilities of each position. A separate `rollout`
is served as GRPO's. The worker half (plugins/workers/gkd_worker.py) gives the unchanged GKDTrainer the teacher server
and points DistillationConfig at the servers.
"""
from __future__ import annotations

from typing import Any

from dualrun.config.refusals import local_model
from dualrun.config.model import JobConfig, RoleSpec
from dualrun.contract.errors import ConfigError
from dualrun.methods.plugin import MethodPlugin
from dualrun.plugins.grpo import ROLLOUT_SERVES, refuse_cpu_engine_training, require_vllm
from dualrun.plugins.workers.gkd_worker import FULL_VOCAB_HINT
from dualrun.config.engine_kinds import HEALTH_PATH
from dualrun.methods.commands import server_argv, validate_server_role


class GKDPlugin(MethodPlugin):
    name = "gkd"
    roles = ("train", "teacher", "rollout")
    required_roles = ("train",)
    weight_roles = frozenset({"rollout"})   # DistillationTrainer sends its weights to a separate rollout, as GRPO's
    # workers/gkd_worker.py: a colocated teacher's model fills GKDConfig, a user-run one's gives the vocabulary size;
    # top_k truncates a colocated teacher and is what a teacher server is asked for
    role_key_reads = {"teacher": {"model": ("colocated", "address"), "top_k": ("colocated", "separate", "address")}}

    def validate(self, cfg: JobConfig) -> None:
        super().validate(cfg)
        teacher = cfg.role("teacher")
        if teacher is not None and cfg.is_separate("teacher"):
            if not teacher.top_k:
                raise ConfigError(cfg.source, "roles.teacher.top_k", "a top-k of at least 1 for a separate teacher",
                                  "full-vocabulary distillation" if teacher.top_k is None else teacher.top_k,
                                  FULL_VOCAB_HINT)
            validate_server_role(cfg, teacher, "the teacher model")
        elif teacher is not None and teacher.model:   # GKDConfig loads it in every trainer process
            local_model(cfg.source, "roles.teacher.model", teacher.model, here=cfg.backend_kind.files_here(cfg))
        rollout = cfg.role("rollout")
        if rollout is not None and cfg.is_separate("rollout"):
            validate_server_role(cfg, rollout, ROLLOUT_SERVES)
        elif rollout is not None:   # the worker half reads a rollout server's address only; colocated it is inert
            raise ConfigError(cfg.source, "colocate_groups", "no rollout beside the trainers for method gkd (a rollout "
                              "is a separate vLLM server for DistillationTrainer; colocated, nothing reads it)",
                              "rollout", hint="remove roles.rollout from colocate_groups, or remove roles.rollout")

    def check_program(self, cfg: JobConfig, program: Any) -> None:
        """DistillationTrainer sends its weights to a separate rollout before generating, as GRPOTrainer does."""
        rollout = cfg.role("rollout")
        if rollout is not None and cfg.is_separate("rollout") and not rollout.address:
            refuse_cpu_engine_training(cfg, rollout, program, ("DistillationTrainer",))

    def preflight(self, cfg: JobConfig) -> None:
        """A separate rollout is reached through TRL's vLLM client (DistillationTrainer's server mode), as GRPO's."""
        rollout = cfg.role("rollout")
        if rollout is not None and cfg.is_separate("rollout"):
            require_vllm(cfg, rollout)

    def server_command(self, cfg: JobConfig, role: RoleSpec, host: str, port: int) -> list[str] | None:
        if role.name not in ("teacher", "rollout") or not role.model:
            return None
        return server_argv(cfg, role, role.model, host, port, rollout=role.name in self.weight_roles)

    def health_path(self, role: RoleSpec) -> str:
        return HEALTH_PATH


PLUGIN = GKDPlugin
