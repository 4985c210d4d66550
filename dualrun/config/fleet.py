"""A separate role's fleet: the engine replicas it starts with and the bounds it may shrink to and grow to.

Why apart: `min_replicas` and `max_replicas` mean something only where dualrun starts a role's engines behind a
router and a backend can start and stop one while the job runs; the planned count (`gpus / tensor_parallel_size`)
sits between them. Kept as plain values so that the plan, the refusals and the server sets read one record. Pure.
"""
from __future__ import annotations

from dataclasses import dataclass

from dualrun.config.engine_kinds import engine_of
from dualrun.config.model import JobConfig, RoleSpec
from dualrun.contract.errors import ConfigError


@dataclass(frozen=True)
class FleetBounds:
    """`start`: replicas started at launch (the planned count); `low`..`high`: what it may shrink and grow to."""

    start: int
    low: int
    high: int

    @property
    def resizable(self) -> bool:
        """Whether `dualrun scale` may change it at all."""
        return self.high > self.low

    def shown(self) -> str:
        """For `dualrun plan` and the launch's lines."""
        return f"{self.start} started, min {self.low}, max {self.high}"


def planned_count(cfg: JobConfig, role: RoleSpec) -> int:
    """Engines a separate role starts with: its GPUs (or CPU processes) over one engine's size."""
    return max(1, (role.gpus or role.processes) // engine_of(cfg, role).size(role))


def bounds(cfg: JobConfig, role: RoleSpec) -> FleetBounds:
    """The role's fleet as the config sets it (unset bounds: the planned count)."""
    start = planned_count(cfg, role)
    low = role.min_replicas if role.min_replicas is not None else start
    high = role.max_replicas if role.max_replicas is not None else start
    return FleetBounds(start, low, high)


def refuse_bounds(cfg: JobConfig) -> None:
    """`min_replicas`/`max_replicas` where they mean nothing or cannot hold: exit 2, one line naming the key."""
    for role in cfg.roles:
        written = [k for k in ("min_replicas", "max_replicas") if getattr(role, k) is not None]
        if not written or role.address:   # beside `address`: config/refusals.external_roles
            continue
        key = f"roles.{role.name}.{written[0]}"
        if not cfg.is_separate(role.name):
            where = "the trainer role" if role.name == cfg.primary.name else "a role colocated with the trainers"
            raise ConfigError(cfg.source, key, f"no {written[0]} on {where} (only a separate role's engine replicas "
                              "grow and shrink)", getattr(role, written[0]))
        b = bounds(cfg, role)
        if len(written) == 2 and b.low > b.high:
            raise ConfigError(cfg.source, f"roles.{role.name}.min_replicas", f"at most max_replicas ({b.high})", b.low)
        size = "gpus / tensor_parallel_size" if role.gpus else "processes"
        if b.high < b.start:
            raise ConfigError(cfg.source, f"roles.{role.name}.max_replicas", f"at least the planned count ({size} = "
                              f"{b.start}: the replicas started at launch)", b.high)
        if b.low > b.start:
            raise ConfigError(cfg.source, f"roles.{role.name}.min_replicas", f"at most the planned count ({size} = "
                              f"{b.start}: the replicas started at launch)", b.low)
        kind = cfg.backend_kind   # (several torchrun machines: where the replicas sit, plan/optional.py)
        if (b.low, b.high) != (b.start, b.start) and not kind.fleets:
            moved = "max_replicas" if b.high != b.start else "min_replicas"
            raise ConfigError(cfg.source, f"roles.{role.name}.{moved}", f"unset or {b.start} (the planned count) on "
                              f"backend {cfg.backend}: fleets resize on Ray and on torchrun only, for now",
                              getattr(role, moved))
        if b.high > b.start and role.gpu_ids is not None:
            raise ConfigError(cfg.source, f"roles.{role.name}.max_replicas", f"unset or {b.start} beside gpu_ids "
                              "(they fix every replica's GPUs; the spare replicas take free ones)", b.high)
