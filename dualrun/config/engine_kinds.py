"""What an inference engine is: the one place an engine's name is looked up (as `backends.py` is a backend's).

Why a record: the layers that place, start, wire and check a separate role's servers ask what its engine does
(does it take the trainer's weights? how many devices does one engine take? which env and command does its
server need?), never which engine it is. Adding an engine is one record here and one command builder in
`dualrun/methods/commands.py` (named by `command`: the builders stay beside the other command lines, above the
plan that places the replicas). Which roles take the trainer's weights is the method's to say
(`MethodPlugin.weight_roles`), not the engine's: the engine says only whether it can.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Collection, Mapping, Protocol

if TYPE_CHECKING:
    from dualrun.config.model import JobConfig, RoleSpec

HEALTH_PATH = "/health"   # vLLM's OpenAI server and dualrun's CPU engine answer it alike


@dataclass(frozen=True)
class EngineKind:
    """`takes_weights`: its replicas can take the trainer's weights (weight-transfer endpoints; a restarted one is
    held out of rotation until its first update). `parallel`: one engine spans `tensor_parallel_size x
    data_parallel_size` devices (else one process). `needs_gpus`: it needs GPUs (or vLLM's CPU build, asked of the
    installed packages where it is checked). `in_trainers`: TRL can run it inside the trainer processes (colocate
    mode: it takes `tensor_parallel_size` there and sleeps with `offload_model`). `quiet_on_cpu`: on a CPU config
    its replicas are marked to wait instead of spin and to share the machine's cores (servers/quiet_readers.py,
    servers/cpu_share.py). `weight_env`: the env a server whose replicas take weights needs (TRL's client endpoints
    behind vLLM's dev mode). `command`: the name of its command builder in `methods.commands.ENGINE_COMMANDS`."""

    name: str
    takes_weights: bool
    parallel: bool
    needs_gpus: bool
    in_trainers: bool
    quiet_on_cpu: bool
    command: str
    health_path: str = HEALTH_PATH
    weight_env: Mapping[str, str] = field(default_factory=dict)

    def size(self, role: RoleSpec) -> int:
        """Devices (GPUs, or CPU processes where the role has none) one engine of `role` takes."""
        return role.tensor_parallel_size * role.data_parallel_size if self.parallel else 1


VLLM = EngineKind("vllm", takes_weights=True, parallel=True, needs_gpus=True, in_trainers=True, quiet_on_cpu=True,
                  command="vllm_server", weight_env={"VLLM_SERVER_DEV_MODE": "1"})
# dualrun's transformers engine (dualrun/programs/cpu_engine.py): generation only, no weight transfer
CPU_ENGINE = EngineKind("transformers", takes_weights=False, parallel=False, needs_gpus=False, in_trainers=False,
                        quiet_on_cpu=False, command="cpu_server")

ENGINES: Mapping[str, EngineKind] = {kind.name: kind for kind in (VLLM, CPU_ENGINE)}
ON_GPUS, ON_CPUS = VLLM, CPU_ENGINE   # the engine where `engine:` is unset


class WeightRoles(Protocol):
    """What the plan and the weight sync read of a method plugin: the roles whose engines take its weights."""

    weight_roles: Collection[str]


def names() -> tuple[str, ...]:
    """The values the config's `engine` accepts."""
    return tuple(ENGINES)


def engine_kind(name: str) -> EngineKind:
    """The record of the engine named `name` (the config's `engine`, checked against `names()` on load)."""
    return ENGINES[name]


def named_engine(role: RoleSpec) -> EngineKind | None:
    """The engine `role` names (`engine:` as set), None where it names none."""
    return engine_kind(role.engine) if role.engine else None


def engine_of(cfg: JobConfig, role: RoleSpec) -> EngineKind:
    """`engine:` as set; else vLLM on GPUs and the transformers CPU engine where there are none."""
    named = named_engine(role)
    if named is not None:
        return named
    return ON_CPUS if (cfg.use_cpu or role.gpus == 0) else ON_GPUS


def takes_weights(cfg: JobConfig, role: RoleSpec | None, weight_roles: Collection[str]) -> bool:
    """Whether the engines of `role` receive the trainer's weights: the method says the role takes them
    (`weight_roles`) and its engine can (dualrun's CPU engine serves the model it loaded, as its restart does)."""
    return role is not None and role.name in weight_roles and engine_of(cfg, role).takes_weights


def weight_roles_of(method: WeightRoles | None) -> frozenset[str]:
    """The roles of `method` (a method plugin, or None: no method at hand) that take the trainer's weights."""
    return frozenset(method.weight_roles) if method is not None else frozenset()
