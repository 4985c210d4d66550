"""grpo's worker half: the hooks every trainer rank installs before the user's script (the driver half is
plugins/grpo.py).

A separate rollout: the unchanged GRPOConfig is pointed at its server (`use_vllm`, `vllm_mode="server"`,
`vllm_server_host/port` and a free `vllm_group_port`, each only where the user left it at its default); TRL's
AsyncGRPOConfig (trl.experimental.async_grpo) gets `vllm_server_base_url`, and TRL's VLLMClient the gloo
weight-sync path for a rollout on vLLM's CPU build (dualrun.weightsync.trainer.vllm_client), as does AsyncGRPOTrainer's default
`weight_transfer` (dualrun.weightsync.trainer.async_client), and a seed for every sampled prompt where the user set none
(dualrun.rank.rollout_seeds: the same completions run after run). A colocated vLLM rollout: TRL's
colocate mode, sleep mode from `offload_model`.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

from dualrun.contract.protocol import ROLLOUT_ADDRESS, VLLM_GROUP_PORT
from dualrun.weightsync.trainer.vllm_client import install as install_gloo_client
from dualrun.rank.hooks import when_imported
from dualrun.rank.rollout_seeds import follow_training, install as install_rollout_seeds
from dualrun.rank.wiring import fill_defaults, left_at_default, rollout_fields, say


def activate(settings: Mapping[str, Any]) -> None:
    """A separate rollout: TRL's server mode pointed at it (and the gloo path to vLLM's CPU build); a colocated
    vLLM rollout: TRL's colocate mode."""
    address = os.environ.get(ROLLOUT_ADDRESS)
    if address:
        when_imported("trl.trainer.grpo_config", lambda m: wire_rollout(m, "GRPOConfig", address))
        when_imported("trl.generation.vllm_client", install_gloo_client)
        when_imported("trl.generation.vllm_client", seed_rollout)
        when_imported("transformers.trainer_callback", follow_training)
        when_imported("trl.experimental.async_grpo.async_grpo_trainer", install_async_gloo)
        when_imported("trl.experimental.async_grpo.async_grpo_config", lambda m: fill_defaults(
            m.AsyncGRPOConfig, async_rollout_fields(address),
            lambda cfg, filled: say(f"AsyncGRPOConfig: {filled} (rollout server)")))
        return
    fields = colocate_fields(settings)
    if fields:
        when_imported("trl.trainer.grpo_config", lambda m: fill_defaults(
            m.GRPOConfig, fields, lambda cfg, filled: say(f"GRPOConfig: {filled} (colocated rollout)")))


def seed_rollout(module: Any) -> None:
    """TRL's VLLMClient: each sampled prompt seeded from the trainer's seed where the user set no seed."""
    install_rollout_seeds(module, say)


def install_async_gloo(module: Any) -> None:
    """AsyncGRPOTrainer's module: its default weight transfer takes the gloo path for a gloo server (imports TRL's
    async weight-transfer module, hence here and not at the top)."""
    from dualrun.weightsync.trainer.async_client import install

    install(module)


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
