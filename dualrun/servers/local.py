"""The servers a torchrun plan places on this machine: started before the trainers, stopped after them.

Each server binds a port the OS picks. One machine: 127.0.0.1. Several machines (torchrun by hand, like
accelerate): a separate role's servers run on whichever machines the plan gives them (machine 0 first), bind
0.0.0.0 and are advertised at the machine's address on its route to machine 0. A server that needs another
machine's (machine 0's router in front of replicas elsewhere) waits until `start_waiting` gets their addresses:
the multi-machine coordinator (dualrun/servers/machines.py) owns that exchange through torchrun's store and the
health checks of the other machines' servers.
"""
from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Collection, Mapping, TextIO

from dualrun.contract import protocol
from dualrun.config.model import JobConfig
from dualrun.contract.errors import LaunchError
from dualrun.plan.processes import ROUTER, Plan, Process
from dualrun.servers.planned import (addresses, log_name, phases, replica_addresses, server_command,
                                     server_health_path, server_role, wiring_env)
from dualrun.servers.process import ServerError, ServerProcess
from dualrun.servers.serverset import HUNG_EVERY_S, START_TRIES, ServerDeath, ServerSet

WATCH_EVERY_S = 0.25   # how often the watcher looks at this machine's server processes


def port_of(address: str) -> int:
    """The port of a `host:port`."""
    return int(address.rpartition(":")[2])


class LocalServers(ServerSet):
    """Start, health-check, watch and stop the plan's servers for this machine (`cfg.machine_rank`)."""

    def __init__(self, cfg: JobConfig, plugin: Any, plan: Plan, env_for: Callable[[Process], dict[str, str]],
                 log_dir: str | None = None, stream: TextIO | None = sys.stderr, avoid: Collection[str] = ()) -> None:
        super().__init__(plan)
        self.cfg, self.plugin, self.env_for, self.stream = cfg, plugin, env_for, stream
        self.log_dir = log_dir or cfg.torchrun.log_dir or cfg.log_dir
        self.running: dict[int, ServerProcess] = {}  # plan.servers index ->
        self.avoid_ports = {port_of(a) for a in avoid}   # an earlier set's ports: never reused
        self._bound: set[str] = set()       # bind host:port of every server started (`used`)
        self._advertised: dict[int, str] = {}   # plan.servers index -> advertised host:port of its latest process
        self._reported: set[int] = set()    # servers whose end was reported
        self._lock = threading.Lock()       # `start_waiting` (a thread beside torchrun's agent) against `stop`
        self.enable_restarts(cfg)
        self.restartable = frozenset(self.restarts_allowed)   # every machine's replicas that are restarted at all
        if cfg.num_machines > 1:   # each machine restarts the replicas it runs (their router is on machine 0)
            self.restarts_allowed = {i: n for i, n in self.restarts_allowed.items()
                                     if plan.servers[i].node == cfg.machine_rank}
            self.restarts_left = dict(self.restarts_allowed)

    def _endpoint(self) -> tuple[str, str, int]:
        """(bind host, advertised host, port) of a server of this machine."""
        from dualrun.light.ports import free_port, route_address

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

    def _spawn(self, index: int) -> ServerProcess:
        """Start the plan's `index`-th server on a fresh port (a router: in front of its replicas' addresses)."""
        proc = self.plan.servers[index]
        bind, advertised, port = self._endpoint()
        self._bound.add(f"{bind}:{port}")
        # ServerProcess puts this machine's Python into the command
        argv = server_command(self.cfg, self.plugin, proc, bind, port, replica_addresses(self.plan, self.started, index))
        role = server_role(self.cfg, proc)
        server = ServerProcess(proc.label, argv, self.env_for(proc), bind, port,
                               health_path=server_health_path(self.plugin, role, proc),
                               timeout_s=role.health_timeout_s, log_path=self._log_path(proc), stream=self.stream)
        self._advertised[index] = f"{advertised}:{port}"
        return server.start()

    def start(self) -> dict[str, str]:
        """Start every server of this machine, wait until all are healthy; role -> address of the servers known
        here. A server whose inputs run on another machine waits for `start_waiting`.

        On any failure every server started so far is stopped and a LaunchError carries the log's tail."""
        try:
            for phase in phases(self.plan):   # the replicas, then their routers
                spawned = []
                for index in phase:
                    if self.plan.servers[index].node == self.cfg.machine_rank and self._inputs_known(index):
                        self.running[index] = self._spawn(index)
                        spawned.append(index)
                self._wait_all(spawned)
        except ServerError as e:
            self.stop()
            raise LaunchError(str(e)) from None
        except BaseException:
            self.stop()
            raise
        self.addresses = addresses(self.plan, self.started)
        return self.addresses

    def _inputs_known(self, index: int) -> bool:
        """Whether the `index`-th server can start: a router once every replica of its unit runs (here or not)."""
        if self.plan.servers[index].kind != ROUTER:
            return True
        unit = self.plan.servers[index].unit
        return all(i in self.started for i, p in enumerate(self.plan.servers) if p.unit == unit and p.kind != ROUTER)

    def _wait_all(self, indices: list[int]) -> None:
        """All of a phase start at once, then each is waited for."""
        for index in indices:
            self.running[index] = self._wait(index, self.running[index])
            self.started[index] = self._advertised[index]

    def _wait(self, index: int, server: ServerProcess) -> ServerProcess:
        deadline = time.monotonic() + server.timeout_s
        for attempt in range(START_TRIES):
            try:
                server.wait_healthy(deadline)
                return server
            except ServerError as e:
                if not e.lost_port or attempt == START_TRIES - 1:
                    raise
                server.stop()  # the free port was taken between picking and binding it: pick another
                server = self._spawn(index)
                self.running[index] = server
        return server

    def waiting(self) -> list[int]:
        """plan.servers indices of this machine's servers that wait for another machine's addresses."""
        return [i for i, p in enumerate(self.plan.servers) if p.node == self.cfg.machine_rank and i not in self.started]

    def start_waiting(self, remote: Mapping[int, str]) -> dict[int, str] | None:
        """Once the other machines' servers answer (`remote`: index -> address): start this machine's servers that
        waited for them, wait until they are healthy; index -> address of those. ServerError when one fails; None
        when the set is being stopped (a server started meanwhile is stopped at once)."""
        with self._lock:
            if self.stopping:
                return None
            self.started.update(remote)
            todo = self.waiting()
            spawned = {i: self._spawn(i) for i in todo}
            self.running.update(spawned)
        try:
            for index in todo:
                spawned[index] = self._wait(index, spawned[index])
                self.started[index] = self._advertised[index]
        finally:
            if self.stopping:   # stopped meanwhile (the job ended): nothing started here may outlive it
                for server in spawned.values():
                    server.stop()
        if self.stopping:
            return None
        self.addresses = addresses(self.plan, self.started)
        return {i: self.started[i] for i in todo}

    def own(self) -> dict[int, str]:
        """plan.servers index -> advertised address, of the servers this machine runs."""
        return {i: a for i, a in self.started.items() if self.plan.servers[i].node == self.cfg.machine_rank}

    def used(self) -> frozenset[str]:
        return frozenset(self._bound)

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
        from dualrun.light.ports import free_port
        from dualrun.weightsync.group import port_host

        env = wiring_env(self.cfg, self.plugin, self.addresses)
        env.update(protocol.group_port_env(env, free_port(port_host(self.cfg))))
        return env

    # -- watching ------------------------------------------------------------------------------------------
    def check(self) -> ServerDeath | None:
        """One look at this machine's servers: each that has ended is reported (once); the set's `failure`."""
        with self._lock:
            ended = [(i, s) for i, s in self.running.items()
                     if i not in self._reported and s.proc is not None and s.proc.poll() is not None]
            self._reported.update(i for i, _ in ended)
        for index, server in ended:
            self.report(ServerDeath.of(index, server.wait_exit()))
        return self.failure

    # -- the restart hooks of ServerSet._replace / find_hung --------------------------------------------------
    def _others_serving(self, index: int) -> bool:
        """Several machines: the last-replica rule needs the router's view (machine 0's; machine K learns its address
        from the store, `Machines`): another replica of the role is in rotation there."""
        from dualrun.servers import router_client
        from dualrun.servers.replacing import router_of

        if self.cfg.num_machines == 1:
            return True
        router, slot = router_of(self.plan, index)
        if router not in self.started:
            return False   # died before its router answered: the job ends
        try:
            return any(i != slot for i in router_client.replicas(self.started[router], timeout_s=2.0)["in_rotation"])
        except (OSError, ValueError, KeyError):
            return False

    def _respawn(self, index: int) -> tuple[str, float] | None:
        """The replica's process again on its devices, on a fresh port (never the dead one's), healthy."""
        with self._lock:
            if self.stopping:
                return None
            dead = self.running.pop(index, None)   # ended: its output was drained by `wait_exit`
            self.avoid_ports.add(port_of(self._advertised[index]))
            self.running[index] = self._spawn(index)
        if dead is not None:
            dead.stop(0)   # the helpers its group may have left (vLLM's engine core)
        server = self._wait(index, self.running[index])
        return self._advertised[index], server.timeout_s

    def _serving(self, index: int, address: str) -> bool:
        with self._lock:
            if self.stopping:
                return False
            self.started[index] = address
            self._reported.discard(index)   # its next death is an event too
        return True

    def _alive(self, index: int) -> bool:
        server = self.running.get(index)
        return server is not None and server.alive()

    def _stop_hung(self, index: int) -> tuple[str, str | None]:
        from dualrun.servers.replacing import HUNG_GRACE_S

        with self._lock:
            self._reported.add(index)   # its end is reported by find_hung, as hung, not as an exit
            server = self.running[index]
        server.stop(HUNG_GRACE_S)
        return server.tail(), server.log_path

    def _watch(self) -> None:
        def loop() -> None:
            last = 0.0
            while self.watching:
                self.check()
                if self.restarts_left and time.monotonic() - last >= HUNG_EVERY_S:
                    last = time.monotonic()
                    self.find_hung(last)
                time.sleep(WATCH_EVERY_S)

        threading.Thread(target=loop, name="dualrun-server-watch", daemon=True).start()

    def _stop(self, grace_s: float) -> None:
        with self._lock:
            servers = list(self.running.values())
            self.running.clear()
        for server in servers:
            server.stop(grace_s)
