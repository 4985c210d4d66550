"""A config section's keys checked against their schema entries: the core's (`ray:`, `torchrun:`) and the ones a
backend declares (`Backend.section_keys`), which the config reads from the installed backends so that a plug-in
backend owns a section as the built-in ones do."""
from __future__ import annotations

from typing import Any, Mapping

from dualrun.config import schema
from dualrun.config.model import frozen_map
from dualrun.config.values import check, did_you_mean
from dualrun.contract.errors import ConfigError


def keyed(source: str, name: str, key: schema.Key, value: Any) -> Any:
    """One dualrun key's value checked against its schema entry; null for a key whose default is unset (`—` in the
    reference) leaves it unset, as not writing it does."""
    if value is None and key.default is None:
        return None
    return check(source, name, key.type, value, key.choices, key.minimum, key.maximum)


def section(source: str, name: str, raw: Mapping[str, Any], keys: tuple[schema.Key, ...]) -> dict[str, Any]:
    """The section `name`'s keys as written, each checked (an unknown one named with the closest known)."""
    known = {k.name: k for k in keys}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in known:
            raise ConfigError(source, f"{name}.{key}", f"a known `{name}` key", "an unknown key",
                              did_you_mean(str(key), known))
        out[key] = keyed(source, f"{name}.{key}", known[key], value)
    if "runtime_env" in out or "env" in out:
        for k in ("runtime_env", "env"):
            if k in out:
                out[k] = frozen_map(out[k])
    return out


def backend_sections(source: str, raw: Mapping[str, Any], owned: Mapping[str, Any],
                     job_backend: Any) -> Mapping[str, Mapping[str, Any]]:
    """The backends' own sections (`Backend.section_keys`): each one the file has, checked whichever backend the job
    runs on (one file serves every backend, as `ray:` and `torchrun:` do), and the job's backend's always, its
    defaults filled in. section -> its frozen values."""
    out: dict[str, Mapping[str, Any]] = {}
    own = getattr(job_backend, "section", None) if getattr(job_backend, "section_keys", ()) else None
    for name, owner in {**owned, **({own: job_backend} if own else {})}.items():
        given = raw.get(name, {})
        if given is None:
            given = {}
        if not isinstance(given, dict):
            raise ConfigError(source, name, f"a mapping of `{name}` keys", given)
        values = {k.name: k.default for k in owner.section_keys}
        values.update(section(source, name, given, tuple(owner.section_keys)))
        owner.check_section(source, values)
        out[name] = frozen_map({k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})
    return frozen_map(out)
