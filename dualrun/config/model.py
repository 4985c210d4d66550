"""Typed, frozen view of a validated config: what every later layer reads."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Collection, Mapping, Sequence

if TYPE_CHECKING:
    from dualrun.config.backends import BackendKind


CLI_SOURCE = "<command line>"   # what an error names as the source of a value a flag gave


def frozen_map(d: Mapping[str, Any] | None = None) -> Mapping[str, Any]:
    return MappingProxyType(dict(d or {}))


@dataclass(frozen=True)
class RoleSpec:
    """One role's resources. `gpus == 0` means CPU processes (`processes` of them)."""

    name: str
    gpus: int
    processes: int
    gpu_ids: tuple[int, ...] | None = None
    engine: str | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    model: str | None = None
    top_k: int | None = None
    address: str | None = None
    health_timeout_s: float = 600.0
    request_timeout_s: float = 1800.0
    replica_restarts: int = 3
    min_replicas: int | None = None   # the fewest engine replicas the job goes on with (None: the planned count)
    max_replicas: int | None = None   # the most `dualrun scale` may grow the role to (None: the planned count)
    server_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=frozen_map)
    machines: tuple[int, ...] | None = None   # torchrun: the machine ranks the role runs on (servers, or ranks)


@dataclass(frozen=True)
class RayOptions:
    address: str | None = None
    placement_strategy: str = "PACK"
    placement_timeout_s: float = 120.0
    num_cpus_per_worker: float = 1.0
    include_dashboard: bool = False
    runtime_env: Mapping[str, Any] = field(default_factory=frozen_map)


@dataclass(frozen=True)
class TorchrunOptions:
    rdzv_backend: str = "static"
    monitor_interval: float = 0.1
    log_dir: str | None = None
    gpus_per_machine: int | None = None   # each machine's GPUs (CPU: process slots); None: not known
    machine_timeout_s: float = 60.0      # several machines: silence before a machine is taken for lost
    rendezvous_timeout_s: int = 600      # several machines: how long each waits for the others to join


@dataclass(frozen=True)
class JobConfig:
    """A validated job. `accelerate` holds the accelerate keys exactly as accelerate reads them."""

    source: str
    accelerate: Mapping[str, Any]
    backend: str = "torchrun"
    method: str = "sft"
    roles: tuple[RoleSpec, ...] = ()
    colocate_groups: tuple[tuple[str, ...], ...] = ()
    offload_model: bool = False
    offload_optimizer: bool = False
    max_failures: int = 0
    collective_timeout_s: float | None = None
    weight_sync_timeout_s: float = 120.0   # forming the trainer<->vLLM weight-sync group (weightsync/wire.py)
    env: Mapping[str, str] = field(default_factory=frozen_map)
    log_dir: str | None = None
    ray: RayOptions = field(default_factory=RayOptions)
    torchrun: TorchrunOptions = field(default_factory=TorchrunOptions)
    # role -> the ms-swift `device_groups` group it was made from: errors about it name what the user wrote
    written_as: Mapping[str, str] = field(default_factory=frozen_map)
    # the accelerate keys the user wrote (file or flag); the rest of `accelerate` is dualrun's defaults
    written: frozenset[str] = frozenset()
    # the accelerate keys given as command-line flags: errors found after loading name them `--key` too
    flags: frozenset[str] = frozenset()
    # the backends' own sections (a plug-in backend's `Backend.section_keys`): section -> its checked values
    sections: Mapping[str, Mapping[str, Any]] = field(default_factory=frozen_map)
    # num_machines left unset and found where the job is launched (`Backend.machines_found`): what they are
    machines_from: str | None = None

    def where(self, key: str) -> tuple[str, str]:
        """Where an accelerate key's value came from, as an error names it (`key_origin`)."""
        return key_origin(self.source, key, self.flags)

    @property
    def backend_kind(self) -> "BackendKind":
        """What the backend is like (config/backends.py): the layers below the launchers ask this, not its name."""
        from dualrun.config.backends import kind_of

        return kind_of(self.backend)

    # -- accelerate facts dualrun needs ------------------------------------------------------------
    @property
    def num_machines(self) -> int:
        return int(self.accelerate.get("num_machines") or 1)

    @property
    def machine_rank(self) -> int:
        return int(self.accelerate.get("machine_rank") or 0)

    @property
    def main_process_ip(self) -> str | None:
        return self.accelerate.get("main_process_ip")

    @property
    def main_process_port(self) -> int | None:
        port = self.accelerate.get("main_process_port")
        return int(port) if port else None

    @property
    def use_cpu(self) -> bool:
        return bool(self.accelerate.get("use_cpu")) or self.accelerate.get("distributed_type") == "MULTI_CPU"

    # -- roles ------------------------------------------------------------------------------------
    def role(self, name: str) -> RoleSpec | None:
        return next((r for r in self.roles if r.name == name), None)

    @property
    def primary(self) -> RoleSpec:
        """The role whose processes run the user's program: `train`, else the first role declared."""
        return self.role("train") or self.roles[0]

    @property
    def num_processes(self) -> int:
        return self.primary.processes

    @property
    def trainer_machines(self) -> tuple[int, ...]:
        """torchrun: the machines that run trainer ranks, in order (the trainers' `machines`, else all)."""
        primary = self.primary
        names = set(self.group_of(primary.name))
        ordered = [primary] + [r for r in self.roles if r.name in names and r is not primary]
        return trainer_machines(ordered, [list(names)], self.num_machines)

    def group_of(self, name: str) -> tuple[str, ...]:
        """The colocate group a role belongs to (itself alone when separate)."""
        for group in self.colocate_groups:
            if name in group:
                return group
        return (name,)

    def is_separate(self, name: str) -> bool:
        """A role with its own devices and processes (a server), not living inside the trainers."""
        primary = self.primary.name
        return name != primary and primary not in self.group_of(name)


def key_origin(source: str, key: str, flags: Collection[str]) -> tuple[str, str]:
    """Where an accelerate key's value came from, as an error names it: its flag (`<command line>`, `--key`) when
    `flags` holds it, else the file's key."""
    return (CLI_SOURCE, f"--{key}") if key in flags else (source, key)


def trainer_group(roles: Sequence[Any], groups: Sequence[Sequence[str]]) -> set[str]:
    """The names of the trainers' roles: the primary role (the first) and the roles colocated with it."""
    primary = roles[0].name
    return next((set(g) for g in groups if primary in g), {primary})


def trainer_machines(roles: Sequence[Any], groups: Sequence[Sequence[str]], num_machines: int) -> tuple[int, ...]:
    """torchrun: the machines that run trainer ranks, in order: the trainers' `machines` where one of them gives it,
    else every machine of the job."""
    if not roles:
        return tuple(range(num_machines))
    names = trainer_group(roles, groups)
    given = next((r.machines for r in roles if r.name in names and r.machines is not None), None)
    return tuple(sorted(given)) if given is not None else tuple(range(num_machines))
