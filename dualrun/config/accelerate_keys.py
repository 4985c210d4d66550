"""accelerate's launch keys that dualrun acts on itself, or refuses, instead of only checking their types.

Why: accelerate's config files carry launch settings for launchers dualrun is not (mpirun, TPU pods, `accelerate
tpu-config`'s commands). Keys that only describe such a launcher are accepted and do nothing on a torchrun or Ray
launch, as they do nothing in `accelerate launch`'s multi-GPU/CPU path (TRL's configs carry them); a key asking for
something to be run that dualrun never runs is refused; `rdzv_backend` is torchrun's rendezvous and is honoured.
"""
from __future__ import annotations

from typing import Any, Mapping

from dualrun.config import schema
from dualrun.contract.errors import ConfigError

# accelerate keys whose non-default value asks for a launcher or commands dualrun does not have: what to do instead.
RUNS_NOTHING: dict[str, str] = {
    "commands": "no commands (`accelerate tpu-config` runs them on TPU VMs; dualrun runs none: run them first)",
    "command_file": "no command file (`accelerate tpu-config` runs it on TPU VMs; dualrun runs none: run it first)",
    "mpirun_config": "no mpirun settings (dualrun launches through torchrun or Ray, never mpirun)",
}


def refuse_launchers(source: str, acc: Mapping[str, Any]) -> None:
    """A non-default `commands`, `command_file` or `mpirun_config` (one with a value set) is refused: one line."""
    for key, instead in RUNS_NOTHING.items():
        value = acc.get(key)
        if isinstance(value, Mapping):
            value = {k: v for k, v in value.items() if v is not None}
        if value:
            raise ConfigError(source, key, instead, value)


def rendezvous(source: str, acc: Mapping[str, Any], torchrun: dict[str, Any]) -> dict[str, Any]:
    """The `torchrun:` section's keys with accelerate's top-level `rdzv_backend` as its `rdzv_backend` where that
    is not set (accelerate's config files write it there); both set and different: refused."""
    value = acc.get("rdzv_backend")
    if value is None:
        return torchrun
    choices = next(k.choices for k in schema.TORCHRUN_KEYS if k.name == "rdzv_backend")
    if value not in choices:
        raise ConfigError(source, "rdzv_backend", f"one of {', '.join(choices)} (torchrun's rendezvous)", value)
    own = torchrun.get("rdzv_backend")
    if own is not None and own != value:
        raise ConfigError(source, "torchrun.rdzv_backend", f"the rendezvous of accelerate's rdzv_backend, {value} "
                          "(or leave one of them out)", own)
    return {**torchrun, "rdzv_backend": value}
