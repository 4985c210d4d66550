"""What the role API needs from a config: one `GroupSpec` per role, and how it travels to a driver.

A group is a config role. Colocated roles (a `colocate_groups` entry, or one ms-swift device group listing
several workers) share one *unit*: on Ray, one placement group whose bundles all of their actors use.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from dualrun.contract import protocol
from dualrun.config.model import RayOptions, frozen_map


@dataclass(frozen=True)
class GroupSpec:
    name: str
    size: int                     # workers (processes) in the group
    gpus: int                     # 0: CPU workers
    unit: tuple[str, ...]         # the roles sharing this group's devices (itself alone when separate)
    env: Mapping[str, str] = field(default_factory=dict)
    model: str | None = None
    engine: str | None = None
    devices: tuple[int, ...] = ()  # torchrun: this machine's GPU ids the plan gives the role (its workers split them)

    @property
    def unit_name(self) -> str:
        return "+".join(self.unit)


@dataclass(frozen=True)
class RolesSpec:
    """Groups plus the config's Ray options (the same `RayOptions` a JobConfig holds); serialisable to one env
    var."""

    groups: tuple[GroupSpec, ...] = ()
    source: str = "<no config>"
    ray: RayOptions = field(default_factory=RayOptions)
    env: Mapping[str, str] = field(default_factory=dict)

    def group(self, name: str) -> GroupSpec | None:
        return next((g for g in self.groups if g.name == name), None)

    @property
    def configured(self) -> bool:
        return bool(self.groups)

    def to_json(self) -> str:
        ray = {**{k: getattr(self.ray, k) for k in RayOptions.__dataclass_fields__},
               "runtime_env": dict(self.ray.runtime_env)}
        d = {"groups": [asdict(g) for g in self.groups], "source": self.source, "ray": ray, "env": dict(self.env)}
        return json.dumps(d, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "RolesSpec":
        d = json.loads(text)
        groups = tuple(GroupSpec(**{**g, "unit": tuple(g["unit"]), "devices": tuple(g.get("devices", ()))})
                       for g in d.pop("groups", []))
        ray = dict(d.pop("ray", None) or {})
        ray["runtime_env"] = frozen_map(ray.get("runtime_env"))
        return RolesSpec(groups=groups, ray=RayOptions(**ray), **d)


def planned_devices(cfg: Any) -> dict[str, tuple[int, ...]]:
    """torchrun: the GPU ids of this machine the plan gives each role (ms-swift's `device_groups` ranks, a role's
    `gpu_ids`, or by count), so a role program's local group workers sit on their role's GPUs as on Ray."""
    if not cfg.backend_kind.per_machine or cfg.use_cpu or not any(r.gpus for r in cfg.roles):
        return {}
    from dualrun.contract.errors import DualrunError
    from dualrun.plan.processes import make_plan

    try:
        plan = make_plan(cfg, environ=os.environ)
    except DualrunError:
        return {}   # `dualrun launch` reports the plan's problem itself
    out: dict[str, list[int]] = {}
    for proc in plan.on_node(cfg.machine_rank):
        for name in proc.roles:
            out.setdefault(name, []).extend(d for d in proc.devices if d not in out.get(name, []))
    return {name: tuple(ids) for name, ids in out.items()}


def spec_from_config(cfg: Any) -> RolesSpec:
    """RolesSpec of a JobConfig (dualrun.config.model.JobConfig)."""
    devices = planned_devices(cfg)
    groups = tuple(GroupSpec(r.name, r.processes, r.gpus, tuple(cfg.group_of(r.name)), dict(r.env), r.model,
                             r.engine, devices.get(r.name, ())) for r in cfg.roles)
    return RolesSpec(groups, cfg.source, cfg.ray, dict(cfg.env))


def load_spec(config: Any = None) -> RolesSpec:
    """From a RolesSpec, a JobConfig, a YAML path, a config dict, or (None) the env a launch set."""
    if isinstance(config, RolesSpec):
        return config
    if config is None:
        raw = os.environ.get(protocol.ROLES_SPEC)
        return RolesSpec.from_json(raw) if raw else RolesSpec()
    from dualrun.config.load import build_config, load_config

    if isinstance(config, (str, os.PathLike)):
        config = load_config(os.fspath(config))
    elif isinstance(config, Mapping):
        config = build_config(config, "<dict>")
    return spec_from_config(config)
