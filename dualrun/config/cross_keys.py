"""Checks across keys: a config that would start ranks on the wrong address, GPUs or files is refused before
anything starts (each check names the key to change)."""
from __future__ import annotations

import os
import re
from typing import Any, Mapping, Sequence

from dualrun.config import schema
from dualrun.config.backends import DEFAULT, kind_of
from dualrun.config.engine_kinds import named_engine
from dualrun.config.model import RayOptions, RoleSpec, TorchrunOptions, trainer_machines
from dualrun.env.installed import vllm_cpu_only
from dualrun.env.worker import reserved
from dualrun.contract.errors import ConfigError

_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})")


def host_port(text: str) -> bool:
    """`host:port` (or `[v6]:port`) with a port in 1-65535; no credentials, paths or spaces."""
    m = _HOST_PORT.fullmatch(text)
    return bool(m) and 1 <= int(m.group(2)) <= 65535


_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


def host_name(text: str) -> bool:
    """A machine's address as torchrun's `--master-addr` takes it (the resolver's): an IPv4 or IPv6 address, or a
    host name (`node-1.cluster.local`); no scheme, port, user, path or space. A name all of digits must be a whole
    IPv4 address (the resolver reads `10` as 0.0.0.10)."""
    import ipaddress

    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        pass
    name = text[:-1] if text.endswith(".") else text
    labels = name.split(".")
    if not name or len(name) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        return False
    return not all(label.isdigit() for label in labels)


def check_ray_address(source: str, address: str | None) -> None:
    """`ray.address`: auto, local, HOST:PORT or ray://HOST:PORT (what resolve_address knows how to join)."""
    if address is None or address in ("auto", "local"):
        return
    if address.lower().startswith(("http://", "https://")):
        raise ConfigError(source, "ray.address", "the cluster's GCS address HOST:6379 (what `ray start --head` "
                          "prints) or ray://HOST:10001, not the dashboard / Jobs URL", address)
    target = address[len("ray://"):] if address.startswith("ray://") else address
    if not host_port(target):
        raise ConfigError(source, "ray.address", "auto, local, HOST:PORT or ray://HOST:PORT (port in 1-65535)",
                          address)


def ray_machines(where: tuple[str, str], machine_rank: int | None) -> None:
    """accelerate's by-hand machine rank on Ray: Ray places the ranks across its nodes from one launch, so a launch
    as machine 1 would start a second job (num_machines stays: the planned node count; main_process_ip stays too, the
    same file runs on both backends, and Ray gives the ranks rank 0's address). `where`: the (source, key) an error
    names (the flag's, or the file's)."""
    if int(machine_rank or 0) != 0:
        raise ConfigError(*where, "0 or unset on Ray", machine_rank,
                          hint="one launch on any node: Ray places the ranks across its nodes")


def check_job(source: str, acc: Mapping[str, Any], values: Mapping[str, Any], roles: Sequence[RoleSpec],
              groups: Sequence[Sequence[str]], ray: RayOptions, torchrun: TorchrunOptions,
              from_flags: bool = False) -> None:
    """`from_flags`: the primary role's size came from `--num_processes`."""
    per_machine = kind_of(values.get("backend", DEFAULT)).per_machine   # every machine launched by hand
    machines = int(acc.get("num_machines") or 1)
    if per_machine and roles:
        with_ranks = len(trainer_machines(roles, groups, machines))
        _check_machine_size(source, roles, groups, with_ranks, from_flags, torchrun.gpus_per_machine)
    rank = int(acc.get("machine_rank") or 0)
    if per_machine and machines > 1 and rank >= 1 and not acc.get("main_process_ip"):
        raise ConfigError(source, "main_process_ip", f"the address of machine 0 (num_machines={machines}, "
                          f"machine_rank={rank}: without it this machine would wait for itself)")
    cpu = bool(acc.get("use_cpu")) or acc.get("distributed_type") == "MULTI_CPU"
    if cpu and roles:
        primary = roles[0].name
        with_primary = next((set(g) for g in groups if primary in g), {primary})
        for role in roles:
            # vLLM's CPU build runs a colocated engine on CPUs too (asked last: it reads package metadata)
            named = named_engine(role)
            if named is not None and named.needs_gpus and role.name in with_primary and not role.address \
                    and not vllm_cpu_only():
                raise ConfigError(source, f"roles.{role.name}.engine", "a separate vLLM server on a CPU config "
                                  "(colocated vLLM needs GPUs or vLLM's CPU build, vllm-cpu; take the role out of "
                                  "colocate_groups)", named.name)
    for key, path in (("log_dir", values.get("log_dir")), ("torchrun.log_dir", torchrun.log_dir)):
        if path and os.path.exists(path) and not os.path.isdir(path):
            raise ConfigError(source, key, "a directory (created when missing)", "an existing file")
    check_ray_address(source, ray.address)
    env_vars = ray.runtime_env.get("env_vars") if isinstance(ray.runtime_env, Mapping) else None
    for name in env_vars or {}:
        if reserved(str(name)):
            raise ConfigError(source, f"ray.runtime_env.env_vars.{name}", "a variable dualrun does not set itself",
                              "a reserved name")


def _check_machine_size(source: str, roles: Sequence[RoleSpec], groups: Sequence[Sequence[str]], machines: int,
                        from_flags: bool, per_machine: int | None = None) -> None:
    """torchrun runs every process of a machine there, and the servers of separate roles on machine 0 unless
    `torchrun.gpus_per_machine` spreads them (then the plan bounds each machine): bound both."""
    limit = schema.MAX_PER_MACHINE
    primary = roles[0]
    if -(-primary.processes // machines) > limit:
        key = "--num_processes" if from_flags else f"roles.{primary.name}.gpus"
        raise ConfigError("<command line>" if from_flags else source, key, f"at most {limit} processes per "
                          "machine on torchrun (raise num_machines, or use the Ray backend)", primary.processes)
    if per_machine is not None and -(-primary.processes // machines) > per_machine:
        raise ConfigError(source, "torchrun.gpus_per_machine", f"at least the {-(-primary.processes // machines)} "
                          f"trainer processes of each machine (roles.{primary.name} over {machines} machine(s); "
                          "on CPU a slot is a process)", per_machine)
    with_primary = next((set(g) for g in groups if primary.name in g), {primary.name})
    servers = [r for r in roles if r.name not in with_primary and not r.address]
    used = primary.processes // machines + sum(r.gpus or r.processes for r in servers)
    if servers and used > limit and per_machine is None:
        biggest = max(servers, key=lambda r: r.gpus or r.processes)
        what = "gpus" if biggest.gpus else "processes"
        raise ConfigError(source, f"roles.{biggest.name}.{what}", f"at most {limit} processes on machine 0 with "
                          "the trainers' (torchrun starts separate roles' servers there)", biggest.gpus or
                          biggest.processes)
