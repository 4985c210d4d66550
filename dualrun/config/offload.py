"""`offload_optimizer: true` as accelerate's DeepSpeed setting: optimizer state on the CPU.

Why only DeepSpeed: it is the engine accelerate configures that offloads optimizer state from a config key;
elsewhere the key would promise what nothing does, so it is refused with what to use instead.
"""
from __future__ import annotations

from typing import Any, Mapping

from dualrun.contract.errors import ConfigError

DEVICE_KEY = "offload_optimizer_device"


def offload_optimizer(source: str, acc: Mapping[str, Any]) -> dict[str, Any]:
    """The accelerate keys with `deepspeed_config.offload_optimizer_device: cpu` (a device already chosen wins;
    `none` is no choice: it is what TRL's and accelerate's generated configs write when not offloading)."""
    if acc.get("distributed_type") != "DEEPSPEED":
        raise ConfigError(source, "offload_optimizer", "an accelerate DeepSpeed config (distributed_type: DEEPSPEED "
                          "with deepspeed_config: {zero_stage: 2, offload_optimizer_device: cpu})",
                          acc.get("distributed_type") or "no distributed_type")
    ds = dict(acc.get("deepspeed_config") or {})
    if ds.get("deepspeed_config_file"):
        raise ConfigError(source, "offload_optimizer", "offload settings in the DeepSpeed JSON file itself "
                          "(deepspeed_config.deepspeed_config_file is set; accelerate ignores its other keys)", True)
    if _stage(ds.get("zero_stage")) == 0:
        raise ConfigError(source, "deepspeed_config.zero_stage", "ZeRO stage 1, 2 or 3 with offload_optimizer: true "
                          "(stage 0 partitions nothing and offloads nothing)", ds["zero_stage"])
    if ds.get(DEVICE_KEY) in (None, "none"):   # `none` (TRL's zero*.yaml): not offloaded yet
        ds[DEVICE_KEY] = "cpu"
    return {**acc, "deepspeed_config": ds}


def _stage(value: Any) -> int | None:
    """`zero_stage` as accelerate reads it (an int, or its digits as a string); None when unset or unreadable
    (accelerate's own check reports those)."""
    try:
        return int(value) if value is not None and not isinstance(value, bool) else None
    except (TypeError, ValueError):
        return None
