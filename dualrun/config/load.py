"""Read a YAML config (accelerate keys + dualrun keys), apply CLI overrides, validate, freeze."""
from __future__ import annotations

import datetime
import os
import re
from contextlib import contextmanager
from typing import Any, Iterator, Mapping

from dualrun.config import accelerate_keys, cross_keys, schema

from dualrun.config import refusals
from dualrun.config.backends import DEFAULT, UnknownBackend, backend_object, kind_of, machines_found, section_owner
from dualrun.config.model import (CLI_SOURCE, JobConfig, RayOptions, RoleSpec, TorchrunOptions, frozen_map,
                                  key_origin, trainer_machines)
from dualrun.config.offload import offload_optimizer
from dualrun.config.role_machines import check_role_machines, parse_machines
from dualrun.config.sections import backend_sections, keyed
from dualrun.config.sections import section as _section
from dualrun.config.swift import convert_device_groups
from dualrun.config.values import check, did_you_mean, parse_ids
from dualrun.config.yamlfile import read_yaml
from dualrun.env.worker import reserved
from dualrun.contract.errors import ConfigError, Said, type_words

# accelerate's flag names that may override the file, as `accelerate launch` spells them.
OVERRIDABLE = ("num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port",
               "mixed_precision")
_ROLE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")


def load_config(path: str | None, overrides: Mapping[str, Any] | None = None,
                backend: str | None = None) -> JobConfig:
    """Build the JobConfig for `path` (None: flags only). CLI overrides win over the file."""
    raw = read_yaml(path) if path is not None else {}   # no file keeps the defaults; `--config_file ''` does not
    return build_config(raw, path or CLI_SOURCE, overrides or {}, backend)


def build_config(raw: Mapping[str, Any], source: str, overrides: Mapping[str, Any] | None = None,
                 backend: str | None = None, environ: Mapping[str, str] | None = None) -> JobConfig:
    """`environ`: where the job is launched (default os.environ): an unset num_machines is the count of machines
    the backend finds there (`Backend.machines_found`: a SLURM allocation's nodes), else 1."""
    raw = dict(raw)
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    for key in overrides:
        if key not in OVERRIDABLE:
            raise ConfigError(source if source == CLI_SOURCE else "<python>", str(key), "an override with "
                              f"accelerate's name ({', '.join(OVERRIDABLE)})", "an unknown keyword",
                              did_you_mean(str(key), OVERRIDABLE))
    for key in raw:
        if not isinstance(key, str):
            raise ConfigError(source, str(key), "string keys", Said(type_words(key)))

    refused = next((k for k in raw if k in schema.REFUSED), None)
    if refused is not None:
        raise ConfigError(source, refused, schema.REFUSED[refused], raw[refused])
    known_top = {k.name: k for k in schema.TOP_KEYS}
    unknown = [k for k in raw if k not in known_top and k not in schema.ACCELERATE_TYPES and k != schema.SWIFT_KEY]
    owned = {k: owner for k in unknown if (owner := section_owner(k)) is not None}   # a backend's own section
    unknown = [k for k in unknown if k not in owned]
    if unknown:
        name = unknown[0]
        raise ConfigError(source, name, "a known key (accelerate's or dualrun's)", "an unknown key",
                          did_you_mean(name, schema.all_top_level_names()))

    # accelerate's keys keep accelerate's meaning; dualrun only checks their types.
    acc: dict[str, Any] = {}
    if raw.get("mixed_precision") is False:  # YAML reads an unquoted `no` as false
        raw["mixed_precision"] = "no"
    for key, value in raw.items():
        if key in schema.ACCELERATE_TYPES:
            acc[key] = _accelerate_value(source, key, value)
    for key, value in overrides.items():
        if key in OVERRIDABLE:
            acc[key] = _accelerate_value(CLI_SOURCE, key, value)
    if acc.get("machine_rank") is not None and not 0 <= acc["machine_rank"] < int(acc.get("num_machines") or 1):
        raise ConfigError(*key_origin(source, "machine_rank", overrides),
                          f"an integer in [0, num_machines={acc.get('num_machines') or 1})", acc["machine_rank"])

    accelerate_keys.refuse_launchers(source, acc)

    values: dict[str, Any] = {}
    for key in schema.TOP_KEYS:
        if key.name in raw and key.name not in ("roles", "colocate_groups"):
            values[key.name] = keyed(source, key.name, key, raw[key.name])
    if values.get("offload_optimizer"):
        acc = offload_optimizer(source, acc)
    if values.pop("use_ray", False) and "backend" not in values:
        values["backend"] = "ray"
    if backend is not None:
        values["backend"] = check(CLI_SOURCE, "--backend", "str", backend)
    if "method" in values and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,99}", values["method"]):
        raise ConfigError(source, "method", "a plugin name (letters, digits, _)", values["method"])

    name = values.get("backend", DEFAULT)
    try:
        on_ray = kind_of(name).ray
    except UnknownBackend as e:
        raise ConfigError(*((CLI_SOURCE, "--backend") if backend is not None else (source, "backend")), str(e),
                          name) from None
    if on_ray:
        cross_keys.ray_machines(key_origin(source, "machine_rank", overrides), acc.get("machine_rank"))
    found = machines_found(name, os.environ if environ is None else environ) if acc.get("num_machines") is None \
        else None
    if found is not None:   # unset: the machines the backend finds (its allocation's nodes), not written by the user
        low, high = schema.ACCELERATE_BOUNDS["num_machines"]
        acc["num_machines"] = check(source, "num_machines", "int", found[0], (), low, high)
    raw_roles = raw.get("roles")
    raw_groups = raw.get("colocate_groups")
    origin: dict[str, str] = {}
    if schema.SWIFT_KEY in raw:
        if raw_roles is not None:
            raise ConfigError(source, schema.SWIFT_KEY, "either `roles` or `device_groups`, not both")
        raw_roles, swift_groups, origin = convert_device_groups(source, raw[schema.SWIFT_KEY])
        nnodes, machines = raw[schema.SWIFT_KEY].get("nnodes") or 1, int(acc.get("num_machines") or 1)
        if not on_ray and nnodes != machines:   # torchrun: machines are launched by hand, num_machines counts them
            raise ConfigError(source, f"{schema.SWIFT_KEY}.nnodes", f"num_machines ({machines}) on torchrun, where "
                              "each machine is launched by hand", nnodes,
                              hint="--backend ray places the groups across a cluster's nodes")
        raw_groups = (raw_groups or []) + swift_groups
        if on_ray:   # ms-swift's ranks size the groups; on Ray, Ray picks the devices
            raw_roles = {n: {k: v for k, v in spec.items() if k != "gpu_ids"} for n, spec in raw_roles.items()}
    try:
        roles = _roles(source, raw_roles, acc, overrides, on_ray)
        groups = _groups(source, raw_groups, roles)
        refusals.external_roles(source, raw_roles or {}, roles, groups)   # first: a server you run takes no gpus
        _check_layout(source, roles, groups)
        refusals.server_sizes(source, roles, roles[0].name, groups)
    except ConfigError as e:
        raise as_written(e, origin) from None

    env = _env(source, "env", values.pop("env", {}))
    ray_opts = RayOptions(**_section(source, "ray", values.pop("ray", {}), schema.RAY_KEYS))
    tr_opts = TorchrunOptions(**accelerate_keys.rendezvous(
        source, acc, _section(source, "torchrun", values.pop("torchrun", {}), schema.TORCHRUN_KEYS)))
    try:
        cross_keys.check_job(source, acc, values, roles, groups, ray_opts, tr_opts, "num_processes" in overrides)
        check_role_machines(source, acc, values, roles, groups)
    except ConfigError as e:
        raise as_written(e, origin) from None
    for key, path in (("log_dir", values.get("log_dir")), ("torchrun.log_dir", tr_opts.log_dir)):
        refusals.log_dir(source, key, path)
    refusals.runtime_env(source, ray_opts.runtime_env)

    if "num_processes" in overrides and roles[0].name != "train":   # it sizes roles.train, which this job lacks
        names = ", ".join(r.name for r in roles)
        raise ConfigError(CLI_SOURCE, "--num_processes", f"no --num_processes for roles {names} (size each with "
                          "roles.<name>.gpus or processes)", overrides["num_processes"])
    written = frozenset(k for k, v in acc.items() if v is not None and not (k == "num_machines" and found))
    if acc.get("num_processes") is None or "num_processes" in overrides:
        acc["num_processes"] = roles[0].processes
    acc.setdefault("num_machines", 1)
    acc.setdefault("machine_rank", 0)
    if "distributed_type" not in acc:
        cpu = bool(acc.get("use_cpu"))
        acc["distributed_type"] = "NO" if acc["num_processes"] <= 1 and acc["num_machines"] <= 1 else (
            "MULTI_CPU" if cpu else "MULTI_GPU")
    with_ranks = len(trainer_machines(roles, groups, acc["num_machines"]))
    if kind_of(values.get("backend", DEFAULT)).per_machine and roles[0].processes % with_ranks:
        across = f"num_machines={acc['num_machines']}" if with_ranks == acc["num_machines"] else \
            f"the {with_ranks} machines of roles.{roles[0].name}.machines"
        raise ConfigError(source, "num_processes", f"a multiple of {across}", acc["num_processes"],
                          f"num_machines unset: {found[1]}" if found else "")
    sections = backend_sections(source, raw, owned, backend_object(values.get("backend", DEFAULT)))
    return JobConfig(source=source, accelerate=frozen_map(acc), roles=tuple(roles),
                     colocate_groups=tuple(tuple(g) for g in groups), env=frozen_map(env),
                     ray=ray_opts, torchrun=tr_opts, written_as=frozen_map(origin), written=written,
                     flags=frozenset(k for k in overrides if k in OVERRIDABLE), sections=sections,
                     machines_from=found[1] if found else None, **values)


def as_written(error: ConfigError, origin: Mapping[str, str]) -> ConfigError:
    """An error about a role made from ms-swift's `device_groups` names the group key the user wrote, not the
    `roles.*` key dualrun made of it."""
    parts = str(error.key).split(".")
    group = origin.get(parts[1]) if len(parts) >= 2 and parts[0] == "roles" else None
    if group is None:
        return error
    sub = "workers" if len(parts) == 2 else ("ranks" if parts[2] in ("gpus", "gpu_ids", "processes") else parts[2])
    return ConfigError(error.source, f"{schema.SWIFT_KEY}.{group}.{sub}", error.expected, error.got, error.hint)


@contextmanager
def errors_as_written(written_as: Mapping[str, str]) -> Iterator[None]:
    """Every ConfigError raised inside, through `as_written` (a job's `JobConfig.written_as`): errors found after
    loading (a method's checks, the placement, the pre-flight) name the device_groups key too."""
    try:
        yield
    except ConfigError as e:
        raise as_written(e, written_as) from None


def _accelerate_value(source: str, key: str, value: Any) -> Any:
    """One accelerate key checked for its type, choices and bounds (a flag is named `--key`)."""
    name = f"--{key}" if source == CLI_SOURCE else key
    value = check(source, name, schema.ACCELERATE_TYPES[key], value, schema.ACCELERATE_CHOICES.get(key, ()))
    if key == "main_process_port" and value is not None and not 1 <= value <= 65535:
        raise ConfigError(source, name, "a port number in [1, 65535] (unset: a free port)", value)
    if key == "main_process_ip" and value is not None and not cross_keys.host_name(value):
        raise ConfigError(source, name, "machine 0's IP address or host name (no scheme, port, user or spaces; "
                          "the port is main_process_port)", value)
    low, high = schema.ACCELERATE_BOUNDS.get(key, (None, None))
    return check(source, name, schema.ACCELERATE_TYPES[key], value, (), low, high)


def _env(source: str, key: str, raw: Mapping[Any, Any]) -> Mapping[str, str]:
    """An `env:` mapping as strings; variables dualrun itself sets per rank are refused (they would put ranks on
    the wrong GPUs or addresses)."""
    out = {}
    for name, value in raw.items():
        name = str(name)
        if reserved(name):
            raise ConfigError(source, f"{key}.{name}", "a variable dualrun does not set itself (dualrun sets the "
                              "rank, address and device variables for every process)", Said("a reserved name"))
        if not isinstance(value, (str, int, float, datetime.date)):   # (bool is an int) no list, set or binary
            raise ConfigError(source, f"{key}.{name}", "a string, number or boolean", value)
        out[name] = str(value).lower() if isinstance(value, bool) else str(value)
        refusals.env_entry(source, f"{key}.{name}", name, out[name])
    return frozen_map(out)


def _roles(source: str, raw: Any, acc: Mapping[str, Any], overrides: Mapping[str, Any],
           on_ray: bool = False) -> list[RoleSpec]:
    cpu = bool(acc.get("use_cpu")) or acc.get("distributed_type") == "MULTI_CPU"
    if on_ray and acc.get("gpu_ids") not in (None, "all"):
        raise ConfigError(source, "gpu_ids", "all or unset on Ray", acc["gpu_ids"],
                          hint="Ray gives each rank its GPU; num_processes sizes the job")
    cpu_by_count: list[str] = []   # roles that asked for `gpus: 0` and no `processes`
    if raw is None:
        raw = {"train": {"gpus": acc.get("num_processes") or 1}}
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(source, "roles", "a non-empty mapping of role names to settings", raw)
    known = {k.name: k for k in schema.ROLE_KEYS}
    roles = []
    for name, spec in raw.items():
        if not isinstance(name, str) or not _ROLE_NAME.match(name):
            raise ConfigError(source, f"roles.{name}", "a role name (letters, digits, _ or -)", name)
        spec = {} if spec is None else spec
        if isinstance(spec, int) and not isinstance(spec, bool):
            spec = {"gpus": spec}
        if not isinstance(spec, dict):
            raise ConfigError(source, f"roles.{name}", "a mapping like {gpus: 2}", spec)
        vals: dict[str, Any] = {}
        for key, value in spec.items():
            if key not in known:
                raise ConfigError(source, f"roles.{name}.{key}", "a known role key", "an unknown key",
                                  did_you_mean(str(key), known))
            k = known[key]
            if value is None and k.default is None:
                vals[key] = None   # null: unset, as the reference's `—` says
            elif key == "gpu_ids":
                vals[key] = parse_ids(source, f"roles.{name}.gpu_ids", value)
            elif key == "machines":
                vals[key] = parse_machines(source, f"roles.{name}.machines", value)
            else:
                vals[key] = keyed(source, f"roles.{name}.{key}", k, value)
        if name == "train" and "num_processes" in overrides:
            vals["gpus"] = overrides["num_processes"]
            vals.pop("processes", None)
        if vals.get("gpu_ids") is not None and (cpu or on_ray):
            raise ConfigError(source, f"roles.{name}.gpu_ids", "no gpu_ids " + (
                "on Ray" if on_ray else "on a CPU config (use_cpu or MULTI_CPU)"), list(vals["gpu_ids"]),
                hint="Ray gives each rank and server its GPUs; `gpus: N` sizes the role" if on_ray else
                "the role runs CPU processes, on no GPU: `gpus` or `processes` counts them")
        if vals.get("gpus") == 0 and vals.get("processes") is None and not vals.get("address"):
            cpu_by_count.append(name)
        if vals.get("gpu_ids") is not None and vals.get("gpus") is None:
            vals["gpus"] = len(vals["gpu_ids"])
        if vals.get("gpus") is None and vals.get("processes") is None:
            if name == "train":
                vals["gpus"] = acc.get("num_processes") or 1
            elif vals.get("address"):
                vals["gpus"] = 0
            else:
                raise ConfigError(source, f"roles.{name}.gpus", "an integer >= 0 (the role's GPU count)")
        gpus = vals.get("gpus")
        if gpus is None:
            gpus = 0 if cpu else vals["processes"]
        if cpu:
            processes = vals.get("processes") or max(gpus, 1)
            gpus = 0
        else:
            processes = vals.get("processes") or max(gpus, 1)
        if vals.get("gpu_ids") is not None and len(vals["gpu_ids"]) != gpus and not cpu:
            raise ConfigError(source, f"roles.{name}.gpu_ids", f"{gpus} ids (roles.{name}.gpus)",
                              list(vals["gpu_ids"]))
        tp = vals.get("tensor_parallel_size", 1)
        if gpus and gpus % tp:
            raise ConfigError(source, f"roles.{name}.tensor_parallel_size", f"a divisor of roles.{name}.gpus={gpus}",
                              tp)
        addr = vals.get("address")
        if addr is not None and not cross_keys.host_port(addr):
            raise ConfigError(source, f"roles.{name}.address", "host:port with a port in [1, 65535]", addr)
        server_args = refusals.server_args(source, f"roles.{name}.server_args", vals.pop("server_args", []))
        env = _env(source, f"roles.{name}.env", vals.pop("env", {}))
        vals.pop("gpus", None)
        vals.pop("processes", None)
        roles.append(RoleSpec(name=name, gpus=gpus, processes=processes, server_args=server_args, env=env, **vals))
    train = next((r for r in roles if r.name == "train"), None)
    if train is not None:
        roles.remove(train)
        roles.insert(0, train)
        n = acc.get("num_processes")
        if n is not None and "num_processes" not in overrides and n != train.processes:
            raise ConfigError(source, "num_processes", f"the same count as roles.train ({train.processes})", n)
    if not cpu and roles[0].name in cpu_by_count:
        raise ConfigError(source, f"roles.{roles[0].name}.gpus", "at least 1 GPU for the trainers on a GPU config "
                          f"(distributed_type {acc.get('distributed_type') or 'unset'}, no use_cpu)", 0,
                          hint="for CPU processes: `processes: N` beside `gpus: 0`, or use_cpu: true")
    if acc.get("gpu_ids") not in (None, "all") and roles[0].gpu_ids is None and not cpu:
        ids = parse_ids(source, "gpu_ids", acc["gpu_ids"])
        if ids is not None and len(ids) < roles[0].gpus:  # accelerate would widen nothing: too few GPUs named
            raise ConfigError(source, "gpu_ids", f"at least {roles[0].gpus} ids (one per process of "
                              f"roles.{roles[0].name})", acc["gpu_ids"])
        if ids is not None:
            from dataclasses import replace

            roles[0] = replace(roles[0], gpu_ids=ids[: roles[0].gpus] if acc.get("num_machines", 1) == 1 else None)
    return roles


def _groups(source: str, raw: Any, roles: list[RoleSpec]) -> list[list[str]]:
    if raw is None:
        return []
    if not isinstance(raw, list) or not all(isinstance(g, list) for g in raw):
        raise ConfigError(source, "colocate_groups", "a list of lists of role names, like [[train, rollout]]", raw)
    names = [r.name for r in roles]
    seen: set[str] = set()
    groups = []
    for i, group in enumerate(raw):
        if len(group) < 2:
            raise ConfigError(source, f"colocate_groups[{i}]", "at least two role names", group)
        for name in group:
            if name not in names:
                raise ConfigError(source, f"colocate_groups[{i}]", "names of roles defined under `roles`", name,
                                  did_you_mean(str(name), names))
            if name in seen:
                raise ConfigError(source, f"colocate_groups[{i}]", "each role in at most one group", name)
            seen.add(name)
        groups.append(list(group))
    return groups


def _check_layout(source: str, roles: list[RoleSpec], groups: list[list[str]]) -> None:
    by_name = {r.name: r for r in roles}
    for i, group in enumerate(groups):
        counts = {n: (by_name[n].gpus or by_name[n].processes) for n in group}
        if len(set(counts.values())) > 1:
            shown = ", ".join(f"{n}={c}" for n, c in counts.items())
            raise ConfigError(source, f"colocate_groups[{i}]", "colocated roles with equal gpus", shown)
    # separate units must not share fixed device ids
    owner: dict[int, str] = {}
    grouped = {n: tuple(g) for g in groups for n in g}
    for role in roles:
        if role.gpu_ids is None:
            continue
        unit = grouped.get(role.name, (role.name,))
        for gid in role.gpu_ids:
            other = owner.get(gid)
            if other is not None and other not in unit:
                raise ConfigError(source, f"roles.{role.name}.gpu_ids",
                                  f"GPUs not used by role '{other}' (separate roles must not share GPUs)", gid)
            owner[gid] = role.name
