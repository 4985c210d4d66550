"""The servers a torchrun plan places on this machine (started before the trainers, stopped after them), and the
per-server helpers (command, health path, addresses, wiring env) the Ray servers use too.

Each server binds a port the OS picks. One machine: 127.0.0.1. Several machines (torchrun by hand, like
accelerate): a separate role's servers run on whichever machines the plan gives them (machine 0 first), bind
0.0.0.0 and are advertised at the machine's address on its route to machine 0; each machine starts and watches
its own, and the addresses meet in torchrun's store (dualrun/servers/machines.py: machine 0 starts the routers in
front of every machine's replicas and publishes the trainers' wiring; dualrun/rank/store_wiring.py reads it).
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

        return router_argv(host, port, list(replicas) or [AUTO] * proc.world_size,
                           server_role(cfg, proc).request_timeout_s)
    for name in proc.roles:
        role = cfg.role(name)
        argv = plugin.server_command(cfg, role, host, port) if plugin is not None and role is not None else None
        if argv:
            return [str(a) for a in argv]
    raise LaunchError(f"method '{cfg.method}' has no server for the separate role(s) {', '.join(proc.roles)}", 2)


def server_previews(cfg: JobConfig, plugin: Any, plan: Plan, host: str, node: int | None = None,
                    devices: str | None = None) -> tuple[tuple[str, tuple[str, ...], dict[str, str]], ...]:
    """What a dry run shows of each server that `node` starts (every node's: None): its label, its command from
    `server_command` and the env it adds. Its port (picked free at launch) is `<auto>`, like `host` and `devices`
    where only the launch knows them (Ray: the actor's node IP and GPUs, for a server that has any); else the
    plan's devices."""
    from dualrun.servers.commands import ROLLOUT_SERVER_ENV

    out = []
    for p in plan.servers:
        if node is None or p.node == node:
            argv = server_command(cfg, plugin, p, host, AUTO)  # type: ignore[arg-type]
            planned = p.env.get("CUDA_VISIBLE_DEVICES", "")
            shown = {"CUDA_VISIBLE_DEVICES": devices if devices is not None and p.devices else planned}
            shown.update({k: p.env[k] for k in ROLLOUT_SERVER_ENV if k in p.env})
            out.append((p.label, tuple(argv), shown))
    return tuple(out)


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
        self.started: dict[int, str] = {}   # plan.servers index -> advertised host:port (machine 0: every machine's)
        self.pending: list[int] = []        # routers whose replicas include another machine's: started by `complete`
        self.pending_done: list[int] = []   # those `complete` started
        self.failure: ServerError | None = None   # the first server that died while watched
        self._watching = threading.Event()
        self._lock = threading.Lock()       # `complete` (a thread beside torchrun's agent) against `stop`
        self._stopped = False
        self._misses: dict[int, int] = {}   # remote server index -> failed health checks in a row
        self.finished_elsewhere: Callable[[int], bool] = lambda machine: False   # it said so (the store)
        self.stopped = threading.Event()
        self._next_probe = 0.0

    def _endpoint(self, index: int) -> tuple[str, str, int]:
        """(bind host, advertised host, port) of the plan's `index`-th server."""
        from dualrun.ports import free_port, route_address

        if self.cfg.num_machines == 1:
            return "127.0.0.1", "127.0.0.1", free_port("127.0.0.1", self.avoid_ports)
        main = self.cfg.main_process_ip or "127.0.0.1"
        advertised = main if self.cfg.machine_rank == 0 else route_address(main)   # what machine 0 reaches it at
        return "0.0.0.0", advertised, free_port("0.0.0.0", self.avoid_ports)

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
        """Start every server of this machine, wait until all are healthy; role -> address of the servers known
        here. A router in front of another machine's replicas waits in `pending` for `complete`.

        On any failure every server started so far is stopped and a LaunchError carries the log's tail."""
        try:
            for phase in phases(self.plan):   # the replicas, then their routers
                for index in phase:
                    proc = self.plan.servers[index]
                    if proc.node != self.cfg.machine_rank:  # another machine runs it: it publishes the address
                        continue
                    if proc.kind == ROUTER and not self._has_replicas(index):
                        self.pending.append(index)
                        continue
                    self.running[index] = self._spawn(index, proc, replica_addresses(self.plan, self.started, index))
                self._wait_all([i for i in phase if i in self.running and i not in self.started])
        except ServerError as e:
            self.stop()
            raise LaunchError(str(e)) from None
        except BaseException:
            self.stop()
            raise
        self.addresses = addresses(self.plan, self.started)
        return self.addresses

    def _has_replicas(self, index: int) -> bool:
        unit = self.plan.servers[index].unit
        return all(i in self.started for i, p in enumerate(self.plan.servers) if p.unit == unit and p.kind != ROUTER)

    def _wait_all(self, indices: Sequence[int]) -> None:
        """All of a phase start at once, then each is waited for."""
        for index in indices:
            proc = self.plan.servers[index]
            self.running[index] = self._wait(index, proc, self.running[index],
                                             replica_addresses(self.plan, self.started, index))
            self.started[index] = self.running[index].advertised  # type: ignore[attr-defined]

    def own(self) -> dict[int, str]:
        """plan.servers index -> advertised address, of the servers this machine runs."""
        return {i: a for i, a in self.started.items() if self.plan.servers[i].node == self.cfg.machine_rank}

    def others(self) -> list[int]:
        """plan.servers indices of the servers other machines run."""
        return [i for i, p in enumerate(self.plan.servers) if p.node != self.cfg.machine_rank]

    def facing(self) -> list[int]:
        """plan.servers indices of the servers the trainers talk to: each router, and the replica of a unit
        without one (machine K >= 1 watches those that run elsewhere: they are machine 0's router)."""
        routed = {p.unit for p in self.plan.servers if p.kind == ROUTER}
        return [i for i, p in enumerate(self.plan.servers) if p.kind == ROUTER or p.unit not in routed]

    def complete(self, remote: Mapping[int, str]) -> dict[str, str]:
        """Machine 0, once the other machines' servers answer (`remote`: index -> address): start the routers that
        stand in front of them, wait until they are healthy; role -> address of every server. ServerError when a
        router fails; a router started while `stop` runs is stopped at once."""
        with self._lock:
            if self._stopped:
                return {}
            self.started.update(remote)
            spawned = {i: self._spawn(i, self.plan.servers[i], replica_addresses(self.plan, self.started, i))
                       for i in self.pending}
            self.running.update(spawned)
        try:
            for index, server in spawned.items():
                server = self._wait(index, self.plan.servers[index], server,
                                    replica_addresses(self.plan, self.started, index))
                spawned[index] = server
                self.started[index] = server.advertised  # type: ignore[attr-defined]
        finally:
            if self._stopped:   # stopped meanwhile (the job ended): nothing started here may outlive it
                for server in spawned.values():
                    server.stop()
        if self._stopped:
            return {}
        self.pending_done, self.pending = self.pending, []
        self.addresses = addresses(self.plan, self.started)
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

    def wiring_env(self, store: str = "") -> dict[str, str]:
        """Env for this machine's trainer ranks: the plugin's wiring of the servers' addresses and a free weight-sync
        port (`shared_wiring`); with several machines and servers, only that the ranks read it from torchrun's
        store at `store` (host:port), where machine 0's launcher puts it once every machine's servers answer."""
        if self.cfg.num_machines > 1 and self.plan.servers:
            return {protocol.WIRING_FETCH: store}
        return self.shared_wiring()

    def shared_wiring(self) -> dict[str, str]:
        """The trainers' wiring env (the same for every machine): the plugin's wiring of every server's address and a
        free weight-sync port on this machine (machine 0 holds trainer rank 0, the weight-sync master; only rank 0's
        value is used)."""
        from dualrun.ports import free_port
        from dualrun.rank.wiring import group_port_env
        from dualrun.weight_sync import port_host

        env = wiring_env(self.cfg, self.plugin, self.addresses)
        env.update(group_port_env(env, free_port(port_host(self.cfg))))
        return env

    def check(self) -> ServerError | None:
        """One look at every server: the first that has ended becomes `failure` (kept once set). With several
        machines, the other machines' servers known here are health-checked about once a second (machine 0: every
        replica; machine K: machine 0's routers, `facing`): two misses in a row are a failure too (their own
        machine's launcher names the exit code)."""
        if self.failure is None:
            for server in list(self.running.values()):
                if server.proc is not None and server.proc.poll() is not None:
                    self.failure = server.wait_exit()
                    break
        if self.failure is None and self.cfg.num_machines > 1 and time.monotonic() >= self._next_probe:
            self._next_probe = time.monotonic() + 1.0
            self.failure = self._probe_others()
        return self.failure

    def settle(self) -> ServerError | None:
        """`check` once the ranks failed: another machine's server that just missed a health check gets its second
        look now (about a second), so a dead router is named as the cause, not the ranks that failed for it."""
        self._next_probe = 0.0
        while self.check() is None and any(0 < n < 2 for n in self._misses.values()):
            time.sleep(1.0)
            self._next_probe = 0.0
        return self.failure

    def _probe_others(self) -> ServerError | None:
        from dualrun.servers.process import http_ok

        for index in self.others():
            if index not in self.started:
                continue
            proc = self.plan.servers[index]
            url = f"http://{self.started[index]}{server_health_path(self.plugin, server_role(self.cfg, proc), proc)}"
            self._misses[index] = 0 if http_ok(url, timeout=1.0) else self._misses.get(index, 0) + 1
            if self._misses[index] >= 2 and not self.finished_elsewhere(proc.node):
                return ServerError(proc.label, f"on machine {proc.node} stopped answering its health check ({url}) "
                                   "while the job was running (that machine's launcher names its exit)")
        return None

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

    @property
    def stopping(self) -> bool:
        return self._stopped

    def stop(self) -> None:
        """Stop every server started here (idempotent); used on success, failure and interruption alike."""
        self._watching.clear()
        with self._lock:
            self._stopped = True
            servers = list(self.running.values())
            self.running.clear()
        for server in servers:
            server.stop()
        self.stopped.set()

    def __enter__(self) -> "LocalServers":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
