"""The method's commands put into the plan: each server's command line and health path, as the method's plugin
builds them for a host and port (a router's: dualrun's router in front of its replicas).

Why in the plan: a launcher is built from the plan and runs what it says; `make_plan(cfg, cluster, method)` fills
these in, so no launcher goes back to the config or the method for a server's command. The plugin is passed in
(`ServerMethod`, what a `methods.plugin.MethodPlugin` is to the plan), never imported. Pure.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Collection, Mapping, Protocol, Sequence, runtime_checkable

from dualrun.config.model import JobConfig, RoleSpec
from dualrun.contract.errors import LaunchError
from dualrun.contract.redact import api_key_of
from dualrun.light.interpreter import PYTHON
from dualrun.plan.placement import AUTO
from dualrun.plan.servers import HOST, PORT, ROUTER, replica_slot

# `Plan` and `Process` (plan/processes.py, which builds the plan with this module) are named, not imported.

ROUTER_HEALTH_PATH = "/health"   # dualrun's router (programs/routing.py ROUTES)


@runtime_checkable
class ServerMethod(Protocol):
    """What the plan reads of a method plugin that runs servers for its separate roles (`MethodPlugin`): the
    roles whose engines take its weights, each server's command and health path, the trainers' wiring."""

    weight_roles: Collection[str]

    def server_command(self, cfg: JobConfig, role: RoleSpec, host: str, port: int) -> "list[str] | None": ...

    def health_path(self, role: RoleSpec) -> str: ...

    def wiring_env(self, cfg: JobConfig, servers: Mapping[str, str]) -> dict[str, str]: ...


def router_argv(host: str, port: "int | str", replicas: Sequence[str], request_timeout_s: float | None = None,
                api_key: str | None = None) -> list[str]:
    """dualrun's router's command line (dualrun/programs/router.py; health at `/health`)."""
    argv = [PYTHON, "-m", "dualrun.programs.router", "--host", host, "--port", str(port)]
    for address in replicas:
        argv += ["--replica", address]
    argv += [] if request_timeout_s is None else ["--request-timeout-s", f"{request_timeout_s:g}"]
    return argv + ([] if api_key is None else ["--api-key", api_key])


def server_role(cfg: JobConfig, proc: Process) -> RoleSpec:
    """The role whose settings a server process uses: the first of its unit."""
    role = cfg.role(proc.roles[0])
    assert role is not None
    return role


def server_command(cfg: JobConfig, plugin: ServerMethod | None, proc: Process, host: str, port: "int | str",
                   replicas: Sequence[str] = ()) -> list[str]:
    """The command of one of the plan's servers: the plugin's engine for a replica; for a router, dualrun's
    router in front of `replicas` (their `host:port`, known once they run; `<auto>` in a dry run)."""
    if proc.kind == ROUTER:
        role = server_role(cfg, proc)
        return router_argv(host, port, list(replicas) or [AUTO] * proc.world_size,  # type: ignore[arg-type]
                           role.request_timeout_s, api_key_of(role.server_args))
    for name in proc.roles:
        role = cfg.role(name)
        argv = plugin.server_command(cfg, role, host, port) if plugin is not None and role is not None else None
        if argv:
            return [str(a) for a in argv]
    raise LaunchError(f"method '{cfg.method}' has no server for the separate role(s) {', '.join(proc.roles)}", 2)


def server_health_path(plugin: ServerMethod, role: RoleSpec, proc: Process) -> str:
    return ROUTER_HEALTH_PATH if proc.kind == ROUTER else plugin.health_path(role)


def with_method(plan: Plan, cfg: JobConfig, plugin: ServerMethod) -> Plan:
    """`plan` with each server's command and health path, as the method (`plugin`) builds them: what a launch
    prepares before anything starts (plan/servers.py)."""
    return with_commands(plan, lambda p, host, port, replicas: server_command(cfg, plugin, p, host, port, replicas),
                         lambda p: server_health_path(plugin, server_role(cfg, p), p))


def with_commands(plan: Plan, command: Callable[[Process, str, str, list[str]], Sequence[str]],
                  health_path: Callable[[Process], str]) -> Plan:
    """`plan` with each server's command (`command(proc, HOST, PORT, [replica_slot(i), ...])`) and health path
    (`health_path(proc)`) filled in; its other processes as they are."""
    procs = []
    for p in plan.processes:
        if p.serving is not None:
            slots = [replica_slot(i) for i in range(p.world_size)] if p.kind == ROUTER else []
            p = replace(p, serving=replace(p.serving, command=tuple(command(p, HOST, PORT, slots)),
                                           health_path=health_path(p)))
        procs.append(p)
    return replace(plan, processes=tuple(procs))
