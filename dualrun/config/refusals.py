"""Nothing accepted in silence: values that would fail only later (at `execve`, on another node, in a server's
parser) and keys that would do nothing where they are written are refused here, with the key and what to do.

Pure checks on values and on the file system of this machine (paths are checked where they can be: here).
"""
from __future__ import annotations

import os
import re
from typing import Any, Mapping, Sequence

from dualrun.config import schema
from dualrun.config.engine_kinds import named_engine
from dualrun.contract.errors import ConfigError, Said, type_words
from dualrun.contract.redact import secret_flag

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_SYSTEM_TREES = ("/proc", "/sys")


def server_args(source: str, key: str, value: Sequence[Any]) -> tuple[str, ...]:
    """`server_args` as strings: every item a non-empty string (a number is written as one) without NUL; a
    mapping, list, null or boolean would reach the server's command line as its Python repr."""
    out = []
    for i, item in enumerate(value):
        if isinstance(item, (int, float)) and not isinstance(item, bool):
            item = str(item)
        if not isinstance(item, str) or not item.strip() or "\0" in item:
            flag = value[i - 1] if i and isinstance(value[i - 1], str) and secret_flag(value[i - 1]) else None
            raise ConfigError(source, f"{key}[{i}]", "a non-empty string without NUL (one word of the server's "
                              "command line, e.g. [--max-model-len, '4096'])",
                              Said(f"{type_words(item)} (the value of {flag}: hidden)") if flag else item)
        if packed_flag(item):
            name, *rest = item.split(None, 1)   # ' --x': a flag with a space before it, no value
            shown = [name, *(["***"] if rest and secret_flag(name) else rest)]
            raise ConfigError(source, f"{key}[{i}]", "a flag and its value as two items (the server gets each item "
                              "as one word)", item, hint=f"[{', '.join(shown)}]")
        out.append(item)
    return tuple(out)


def packed_flag(item: str) -> bool:
    """A flag with white space in its name (`--dtype float32`, ` --x`): a flag and its value packed into one item,
    which no shell splits here. A value may hold spaces (`--hf-overrides={"a": 1}`, or a JSON item of its own)."""
    name = item.split("=", 1)[0]
    return item.lstrip().startswith("-") and any(c.isspace() for c in name)


def env_entry(source: str, key: str, name: str, value: str) -> None:
    """One variable for `execve`: a name without `=` or NUL, a value without NUL, `NAME=value` within the kernel's
    limit for one variable (else the job would fail only when its first process starts)."""
    if not name or "=" in name or "\0" in name:
        what = "an empty name" if not name else "a name with '='" if "=" in name else "a name with NUL"
        raise ConfigError(source, key, "a variable name without '=' or NUL", Said(what))
    if "\0" in value:
        raise ConfigError(source, key, "a value without NUL bytes", Said("a value with NUL"))
    size = len(name.encode("utf-8", "surrogateescape")) + 1 + len(value.encode("utf-8", "surrogateescape"))
    if size >= schema.MAX_ENV_ENTRY_BYTES:
        raise ConfigError(source, key, f"NAME=value under {schema.MAX_ENV_ENTRY_BYTES // 1024} KiB (the kernel's "
                          "limit for one variable; pass big data as a file)", Said(f"{size} bytes"))


def runtime_env(source: str, raw: Mapping[str, Any]) -> None:
    """The parts of `ray.runtime_env` Ray checks only when the first actor starts: their types, and a local
    `working_dir` that exists."""
    key = "ray.runtime_env"
    env_vars = raw.get("env_vars")
    if env_vars is not None:
        if not isinstance(env_vars, Mapping):
            raise ConfigError(source, f"{key}.env_vars", "a mapping of variable names to strings", env_vars)
        for name, value in env_vars.items():
            if not isinstance(name, str) or not isinstance(value, str):
                raise ConfigError(source, f"{key}.env_vars.{name}", "a string (quote numbers and booleans: Ray "
                                  "takes strings only)", value)
            env_entry(source, f"{key}.env_vars.{name}", name, value)
    pip = raw.get("pip")
    if pip is not None and not (isinstance(pip, (str, dict)) or
                                (isinstance(pip, list) and all(isinstance(p, str) for p in pip))):
        raise ConfigError(source, f"{key}.pip", "a list of requirements, a requirements file path or a mapping", pip)
    for name in ("py_modules", "excludes"):
        item = raw.get(name)
        if item is not None and not (isinstance(item, list) and all(isinstance(p, str) for p in item)):
            raise ConfigError(source, f"{key}.{name}", "a list of strings", item)
    working_dir = raw.get("working_dir")
    if working_dir is not None:
        if not isinstance(working_dir, str) or not working_dir:
            raise ConfigError(source, f"{key}.working_dir", "a directory path or a URI", working_dir)
        if not _URL.match(working_dir) and not os.path.isdir(os.path.expanduser(working_dir)):
            raise ConfigError(source, f"{key}.working_dir", "an existing directory (Ray uploads it from here)",
                              working_dir)


def log_dir(source: str, key: str, path: str | None) -> None:
    """A directory dualrun can create or use: not empty, not in /proc or /sys, not a file or below one, and on a
    writable file system with permission to write where it is (or would be created)."""
    if path is None:
        return
    if not path.strip() or "\0" in path:
        raise ConfigError(source, key, "a directory path (unset: no log files)", path)
    full = os.path.realpath(os.path.expanduser(path))
    if any(full == t or full.startswith(t + "/") for t in _SYSTEM_TREES):
        raise ConfigError(source, key, "a directory outside /proc and /sys", path)
    probe = full
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            return
        probe = parent
    if not os.path.isdir(probe):
        raise ConfigError(source, key, "a directory (created when missing)",
                          "an existing file" if probe == full else f"a path below the file {probe}")
    why = _unwritable(probe)
    if why:
        raise ConfigError(source, key, "a directory dualrun can write (created when missing)", path, hint=why)


def _unwritable(folder: str) -> str | None:
    """Why files cannot be made in the existing directory `folder` (None: they can)."""
    try:
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            return f"{folder} is on a read-only file system"
    except OSError:
        pass
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"no permission to write in {folder}"
    return None


def local_model(source: str, key: str, model: str | None, here: bool = True) -> None:
    """A model written as a local path (absolute, `./`, `../`, `~`) must be a directory here (a `.gguf` file for
    vLLM) when it is loaded on a machine like this one (`here`); a URL is no model name anywhere. A hub id
    (`org/name`) is left to the hub."""
    if model is None:
        return
    if _URL.match(model):
        raise ConfigError(source, key, "a model directory or a hub id like org/name (not a URL)", model)
    if not here or not model.startswith(("/", "./", "../", "~")):
        return
    path = os.path.expanduser(model)
    if os.path.isdir(path) or (os.path.isfile(path) and path.endswith(".gguf")):
        return
    raise ConfigError(source, key, "an existing model directory (a local path is read on this machine)",
                      f"a file: {model}" if os.path.exists(path) else model)


def external_roles(source: str, raw_roles: Mapping[str, Mapping[str, Any]], roles: Sequence[Any],
                   groups: Sequence[Sequence[str]]) -> None:
    """A role with `address` is a server the user runs: dualrun starts nothing for it, so the keys that size or
    start a server do nothing there, and it cannot share the trainers' GPUs."""
    # each key with the values that are the same as not writing it
    harmless = {"gpus": (None, 0), "processes": (None, 1), "gpu_ids": (None,), "tensor_parallel_size": (None, 1),
                "data_parallel_size": (None, 1), "server_args": (None, []), "health_timeout_s": (None,),
                "request_timeout_s": (None,), "replica_restarts": (None,), "env": (None, {}), "engine": (None,),
                "min_replicas": (None,), "max_replicas": (None,)}
    for role in roles:
        if not role.address:
            continue
        written = raw_roles.get(role.name)
        written = written if isinstance(written, Mapping) else {}
        for name, same in harmless.items():
            if name in written and not any(written[name] == v and type(written[name]) is type(v) for v in same):
                raise ConfigError(source, f"roles.{role.name}.{name}", "nothing beside `address` (dualrun starts "
                                  "no server for it: set it on the server you run, or drop `address` and let "
                                  "dualrun start one)", written[name])
        for i, group in enumerate(groups):
            if role.name in group:
                raise ConfigError(source, f"colocate_groups[{i}]", "roles dualrun runs (roles."
                                  f"{role.name} has an `address`: a server you run, on GPUs of its own)", role.name)


def server_sizes(source: str, roles: Sequence[Any], primary: str, groups: Sequence[Sequence[str]]) -> None:
    """Engines of a separate CPU role (a transformers server each) are processes on the machines: bound them as
    processes of a role are bounded."""
    with_primary = next((set(g) for g in groups if primary in g), {primary})
    for role in roles:
        if role.name in with_primary or role.address or role.gpus:
            continue
        if role.processes > schema.MAX_PER_MACHINE:
            raise ConfigError(source, f"roles.{role.name}.processes", f"at most {schema.MAX_PER_MACHINE} server "
                              "processes for a separate role without GPUs (one engine each)", role.processes)


_DEFAULTS = {"tensor_parallel_size": 1, "data_parallel_size": 1, "server_args": (), "health_timeout_s": 600.0,
             "request_timeout_s": 1800.0, "replica_restarts": 3}


def program_sizes(cfg: Any) -> None:
    """A role program (`single_controller`: runs once, as the driver, its groups sized by their roles) takes
    `num_processes` in accelerate's meaning only: the job's total (each colocate group counted once), or unset. Any
    other number would be accepted and do nothing (several torchrun machines: role_programs/driver.py)."""
    if "num_processes" not in cfg.written:
        return
    n, sizes = cfg.accelerate.get("num_processes"), {}
    for role in cfg.roles:
        group = cfg.group_of(role.name)
        sizes[group] = max(sizes.get(group, 0), role.processes)
    total = sum(sizes.values())
    if n != total:
        parts = " + ".join(f"{'/'.join(g)} {k}" for g, k in sizes.items())
        raise ConfigError(cfg.source, "num_processes", f"unset or {total}, the total of method {cfg.method}'s roles "
                          f"({parts}; each is sized by roles.<name>.gpus or processes)", n)


def _in_trainers(role: Any) -> bool:
    """Whether `role` names an engine TRL runs inside the trainer processes (vLLM's colocate mode): unset, a
    colocated role generates with TRL's own path."""
    named = named_engine(role)
    return named is not None and named.in_trainers


def inert_keys(cfg: Any, engine_roles: Sequence[str] = (), single_controller: bool = False) -> None:
    """Keys that take effect only on a server dualrun starts (or on a colocated vLLM engine of `engine_roles`),
    refused where they would do nothing: on the trainer role, on a role colocated with it, in a role program."""
    primary = cfg.primary.name
    with_primary = set(cfg.group_of(primary))
    for role in cfg.roles:
        if role.address:
            continue   # external_roles: refused beside `address` already
        if single_controller:
            where, instead = "a role program's role", "its groups run the program's own code"
        elif role.name == primary:
            where, instead = "the trainer role", "the trainers' sizes are accelerate's (num_processes, DeepSpeed/FSDP)"
        elif role.name in with_primary:
            where, instead = "a role colocated with the trainers", "out of colocate_groups it gets a server"
        else:
            continue
        colocated_engine = (not single_controller and role.name in engine_roles and role.name != primary
                            and _in_trainers(role))
        for name, default in _DEFAULTS.items():
            value = getattr(role, name)
            if value == default or (name == "tensor_parallel_size" and colocated_engine):
                continue
            if name == "tensor_parallel_size" and role.name in engine_roles and role.name != primary \
                    and not single_controller:
                why = "a colocated rollout takes it with `engine: vllm` only"
            elif name == "data_parallel_size" and colocated_engine:
                why = "TRL's colocate mode takes tensor_parallel_size only"
            else:
                why = f"only a separate role's server takes it; {instead}"
            raise ConfigError(cfg.source, f"roles.{role.name}.{name}", f"no {name} on {where} ({why})",
                              list(value) if isinstance(value, tuple) else value)
    if cfg.offload_model:
        users = [r for r in engine_roles if cfg.role(r) is not None and r in with_primary and r != primary
                 and _in_trainers(cfg.role(r)) and not single_controller]
        if not users:
            raise ConfigError(cfg.source, "offload_model", "a vLLM rollout colocated with the trainers to put to "
                              "sleep (roles.rollout: {engine: vllm} in colocate_groups with train, method grpo); "
                              f"method {cfg.method} has none here: remove offload_model", True)
