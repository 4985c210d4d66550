"""The servers a torchrun plan places on this machine: started before the trainers, stopped after them.

Each server binds a port the OS picks. One machine: 127.0.0.1. Several machines (torchrun by hand, like
accelerate): the servers run on machine 0 and bind 0.0.0.0; the other machines' ranks read the addresses from
torchrun's store when they start (dualrun/rank/store_wiring.py), since the machines do not talk before the job.
"""
from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Collection, Mapping, Sequence, TextIO

from dualrun import protocol
from dualrun.config.model import JobConfig, RoleSpec
from dualrun.errors import LaunchError
from dualrun.plan import AUTO, ROUTER, Plan, Process
from dualrun.servers.process import ServerError, ServerProcess



def server_role(cfg: JobConfig, proc: Process) -> RoleSpec:
    """The role whose settings a server process uses: the first of its unit."""
    role = cfg.role(proc.roles[0])
    assert role is not None
    return role


def server_command(cfg: JobConfig, plugin: Any, proc: Process, host: str, port: int,
                   replicas: Sequence[str] = ()) -> list[str]:
    """The command of one of the plan's servers: the plugin's engine for a replica; for a router, dualrun's
    router in front of `replicas` (their `host:port`, known once they run; `<auto>` in a dry run)."""
    if proc.kind == ROUTER:
        from dualrun.servers.router import router_argv

        return router_argv(host, port, list(replicas) or [AUTO] * proc.world_size)
    for name in proc.roles:
        role = cfg.role(name)
        argv = plugin.server_command(cfg, role, host, port) if plugin is not None and role is not None else None
        if argv:
            return [str(a) for a in argv]
    raise LaunchError(f"method '{cfg.method}' has no server for the separate role(s) {', '.join(proc.roles)}", 2)


def server_health_path(plugin: Any, role: RoleSpec, proc: Process) -> str:
    from dualrun.servers.commands import HEALTH_PATH  # the router's too (routing.ROUTES)

    return HEALTH_PATH if proc.kind == ROUTER else plugin.health_path(role)


def log_name(proc: Process) -> str:
    """A server's log file name: one per replica, and the router's."""
    return f"{proc.unit}-router.log" if proc.kind == ROUTER else f"{proc.unit}-server-{proc.rank}.log"


def phases(plan: Plan) -> list[list[int]]:
    """Indices of `plan.servers` in start order: every engine replica at once, then the routers (which need
    their replicas' addresses)."""
    first = [i for i, p in enumerate(plan.servers) if p.kind != ROUTER]
    routers = [i for i, p in enumerate(plan.servers) if p.kind == ROUTER]
    return [first, routers] if routers else [first]


def replica_addresses(plan: Plan, started: Mapping[int, str], index: int) -> list[str]:
    """For the router at `plan.servers[index]`: the `host:port` of the replicas it stands in front of, in replica
    order (for an engine replica: none)."""
    unit = plan.servers[index].unit
    if plan.servers[index].kind != ROUTER:
        return []
    return [started[i] for i, p in enumerate(plan.servers) if p.unit == unit and p.kind != ROUTER]


def addresses(plan: Plan, started: Mapping[int, str]) -> dict[str, str]:
    """role -> host:port for every server role: the plan's servers (by index; a role with several replicas is its
    router's) and the user's own (`address:`)."""
    out = dict(plan.external)
    routed = {p.unit for p in plan.servers if p.kind == ROUTER}
    for index, addr in started.items():
        proc = plan.servers[index]
        if proc.unit in routed and proc.kind != ROUTER:
            continue
        for name in proc.roles:
            out[name] = addr
    return out


def wiring_env(cfg: JobConfig, plugin: Any, addresses: Mapping[str, str]) -> dict[str, str]:
    """Env for the trainer ranks: the plugin's wiring of the servers' addresses (either backend)."""
    if not addresses or plugin is None:
        return {}
    return dict(plugin.wiring_env(cfg, addresses))


class LocalServers:
    """Start, health-check and stop the plan's servers for this machine (`cfg.machine_rank`)."""

    def __init__(self, cfg: JobConfig, plugin: Any, plan: Plan, env_for: Callable[[Process], dict[str, str]],
                 log_dir: str | None = None, stream: TextIO | None = sys.stderr,
                 avoid_ports: Collection[int] = ()) -> None:
        self.cfg, self.plugin, self.plan, self.env_for, self.stream = cfg, plugin, plan, env_for, stream
        self.log_dir = log_dir or cfg.torchrun.log_dir or cfg.log_dir
        self.running: dict[int, ServerProcess] = {}  # plan.servers index ->
        self.addresses: dict[str, str] = dict(plan.external)
        self.avoid_ports = set(avoid_ports)   # ports of an earlier attempt's servers: never reused
        self.ports_used: set[int] = set()
        self.elsewhere = False   # some server runs on another machine: the wiring comes through the store
        self.failure: ServerError | None = None   # the first server that died while watched
        self._watching = threading.Event()

    def _endpoint(self, index: int) -> tuple[str, str, int]:
        """(bind host, advertised host, port) of the plan's `index`-th server."""
        from dualrun.ports import free_port

        if self.cfg.num_machines == 1:
            return "127.0.0.1", "127.0.0.1", free_port("127.0.0.1", self.avoid_ports)
        return "0.0.0.0", self.cfg.main_process_ip or "127.0.0.1", free_port("0.0.0.0", self.avoid_ports)

    def _log_path(self, proc: Process) -> str:
        if not self.log_dir:
            self.log_dir = tempfile.mkdtemp(prefix="dualrun-servers-")
        os.makedirs(self.log_dir, exist_ok=True)
        return os.path.join(self.log_dir, log_name(proc))

    def _spawn(self, index: int, proc: Process, replicas: Sequence[str] = ()) -> ServerProcess:
        bind, advertised, port = self._endpoint(index)
        self.ports_used.add(port)
        # ServerProcess puts this machine's Python into the command
        argv = server_command(self.cfg, self.plugin, proc, bind, port, replicas)
        role = server_role(self.cfg, proc)
        server = ServerProcess(proc.label, argv, self.env_for(proc), bind, port,
                               health_path=server_health_path(self.plugin, role, proc),
                               timeout_s=role.health_timeout_s, log_path=self._log_path(proc), stream=self.stream)
        server.advertised = f"{advertised}:{port}"  # type: ignore[attr-defined]
        return server.start()

    def start(self) -> dict[str, str]:
        """Start every server of this machine, wait until all are healthy; role -> address of all servers.

        On any failure every server started so far is stopped and a LaunchError carries the log's tail."""
        try:
            started: dict[int, str] = {}
            for phase in phases(self.plan):   # the replicas, then their routers
                for index in phase:
                    proc = self.plan.servers[index]
                    if proc.node != self.cfg.machine_rank:  # another machine runs it: its ranks publish the address
                        self.elsewhere = True
                        continue
                    self.running[index] = self._spawn(index, proc, replica_addresses(self.plan, started, index))
                for index in phase:  # all of a phase start at once, then each is waited for
                    if index in self.running:
                        proc = self.plan.servers[index]
                        self.running[index] = self._wait(index, proc, self.running[index],
                                                         replica_addresses(self.plan, started, index))
                        started[index] = self.running[index].advertised  # type: ignore[attr-defined]
        except ServerError as e:
            self.stop()
            raise LaunchError(str(e)) from None
        except BaseException:
            self.stop()
            raise
        self.addresses = addresses(self.plan, started)
        return self.addresses

    def _wait(self, index: int, proc: Process, server: ServerProcess, replicas: Sequence[str] = ()) -> ServerProcess:
        deadline = time.monotonic() + server.timeout_s
        for attempt in range(3):
            try:
                server.wait_healthy(deadline)
                return server
            except ServerError as e:
                if not e.lost_port or attempt == 2:
                    raise
                server.stop()  # the free port was taken between picking and binding it: pick another
                server = self._spawn(index, proc, replicas)
                self.running[index] = server
        return server

    def wiring_env(self) -> dict[str, str]:
        """Env for the trainer ranks: the plugin's wiring of the servers' addresses and a free weight-sync port on
        this machine (machine 0 holds trainer rank 0, the weight-sync master; only rank 0's value is used); with
        several machines, also whether this machine's ranks publish it (it started servers) or read it."""
        import json

        from dualrun.ports import free_port
        from dualrun.rank.wiring import group_port_env

        if self.elsewhere:
            return {protocol.WIRING_FETCH: "1"}
        env = wiring_env(self.cfg, self.plugin, self.addresses)
        env.update(group_port_env(env, free_port("127.0.0.1" if self.cfg.num_machines == 1 else "0.0.0.0")))
        if self.running and self.cfg.num_machines > 1:
            env.update({protocol.WIRING_PUBLISH: "1", protocol.WIRING_NAMES: json.dumps(sorted(env))})
        return env

    def check(self) -> ServerError | None:
        """One look at every server: the first that has ended becomes `failure` (kept once set)."""
        if self.failure is None:
            for server in list(self.running.values()):
                if server.proc is not None and server.proc.poll() is not None:
                    self.failure = server.wait_exit()
                    break
        return self.failure

    def watch(self, on_death: Callable[[ServerError], None], every_s: float = 0.25) -> None:
        """While the job runs: the first server that ends is recorded in `failure` and `on_death` is called once
        (from a watcher thread). `stop` ends the watch first, so stopping the servers is never a failure."""
        self._watching.set()

        def loop() -> None:
            while self._watching.is_set():
                failure = self.check()
                if failure is not None and self._watching.is_set():
                    self._watching.clear()
                    on_death(failure)
                    return
                time.sleep(every_s)

        threading.Thread(target=loop, name="dualrun-server-watch", daemon=True).start()

    def unwatch(self) -> None:
        self._watching.clear()

    def stop(self) -> None:
        """Stop every server started here (idempotent); used on success, failure and interruption alike."""
        self._watching.clear()
        for server in list(self.running.values()):
            server.stop()
        self.running.clear()

    def __enter__(self) -> "LocalServers":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
