"""The servers the plan puts on this machine (`plan.machine_rank`) run as its processes: started beside the
trainers, watched, restarted by the set's supervisor, stopped after them.

Each server binds a port the OS picks, on the set's `endpoint` (loopback; several machines: machine_servers.py gives the
machine's own). A router starts once its replicas' addresses are known: here, after its replicas; when some run
on another machine, once the multi-machine wrapper (machine_servers.py) has them and calls `start_now`.
"""
from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable, Collection, Mapping, TextIO

from dualrun.contract.errors import LaunchError
from dualrun.plan.processes import ROUTER, Plan, Process
from dualrun.servers.planned import addresses, at_launch, awaited, facing, replica_addresses
from dualrun.servers.process import ServerError, ServerProcess
from dualrun.servers.serverset import START_TRIES, ServerDeath, ServerSetBase
from dualrun.servers.supervisor import Supervisor

WATCH_EVERY_S = 0.25   # how often the watcher looks at this machine's server processes


def port_of(address: str) -> int:
    """The port of a `host:port`."""
    return int(address.rpartition(":")[2])


@dataclass(frozen=True)
class Endpoint:
    """Where this machine's servers bind, and the host the others (the trainers, a router) reach them at."""

    bind: str
    advertised: str


LOOPBACK = Endpoint("127.0.0.1", "127.0.0.1")


class LocalServers(ServerSetBase):
    """Start, health-check, watch and stop the plan's servers for this machine.

    `env_for`: a server's whole env (the launcher's); `wiring`: the trainers' env for the servers' addresses (the
    method's); `avoid`: an earlier set's endpoints, never reused."""

    def __init__(self, plan: Plan, env_for: Callable[[Process], dict[str, str]],
                 wiring: Callable[[Mapping[str, str]], dict[str, str]] = lambda addresses: {}, *,
                 avoid: Collection[str] = (), stream: TextIO | None = sys.stderr, endpoint: Endpoint = LOOPBACK) -> None:
        super().__init__(plan)
        self.env_for, self.wiring, self.stream, self.endpoint = env_for, wiring, stream, endpoint
        here = plan.machine_rank or 0
        self.mine = [i for i, p in enumerate(plan.servers) if p.node == here]   # the servers this machine runs
        self.log_dir: str | None = None     # where a server without the plan's log dir logs (made on first use)
        self.running: dict[int, ServerProcess] = {}  # plan.servers index ->
        self.avoid_ports = {port_of(a) for a in avoid}   # an earlier set's ports: never reused
        self._bound: set[str] = set()       # bind host:port of every server started (`used`)
        self._advertised: dict[int, str] = {}   # plan.servers index -> advertised host:port of its latest process
        self._fixed: dict[int, int] = {}        # index -> the port `reserve` handed out (the trainers have it)
        self._reported: set[int] = set()    # servers whose end was reported
        # a start beside torchrun's agent (backends/torchrun/machine_servers.py) against `stop`
        self._lock = threading.Lock()
        self.supervisor = Supervisor(plan, self, self, lambda index: self.started.get(index), self.mine)

    def _log_path(self, proc: Process) -> str:
        assert proc.serving is not None
        if proc.serving.log_path:
            os.makedirs(os.path.dirname(proc.serving.log_path), exist_ok=True)
            return proc.serving.log_path
        if not self.log_dir:
            self.log_dir = tempfile.mkdtemp(prefix="dualrun-servers-")
        return os.path.join(self.log_dir, proc.serving.log_name)

    def _port(self, index: int) -> int:
        """The port server `index` binds: the one `reserve` handed out, else a fresh one."""
        from dualrun.light.ports import free_port

        return self._fixed.get(index) or free_port(self.endpoint.bind, self.avoid_ports)

    def _spawn(self, index: int) -> ServerProcess:
        """Start the plan's `index`-th server on its port (a router: in front of its replicas' addresses)."""
        proc = self.plan.servers[index]
        serving = proc.serving
        assert serving is not None
        bind, port = self.endpoint.bind, self._port(index)
        self._bound.add(f"{bind}:{port}")
        # ServerProcess puts this machine's Python into the command
        argv = serving.argv(bind, port, replica_addresses(self.plan, self.started, index))
        server = ServerProcess(proc.label, argv, self.env_for(proc), bind, port, health_path=serving.health_path,
                               timeout_s=serving.health_timeout_s, log_path=self._log_path(proc), stream=self.stream)
        self._advertised[index] = f"{self._host_of(index)}:{port}"   # the host `reserve` handed out too
        return server.start()

    def reserve(self) -> dict[str, str] | None:
        """Side by side: the port of each server the trainers talk to, picked now (`fix_ports`); role -> address.
        Only where this machine runs every server (several torchrun machines: `Machines.reserve`)."""
        if not self.plan.servers or set(self.mine) != set(range(len(self.plan.servers))):
            return None
        self.addresses = addresses(self.plan, self.fix_ports(facing(self.plan)))
        return self.addresses

    def fix_ports(self, indices: Collection[int]) -> dict[int, str]:
        """Pick now the port each of these servers will bind (`server_port`: out of the range other processes'
        connections take theirs from, so it stays free until the server binds it), for an address handed out
        before the server answers; the set then starts beside the trainers (`side_by_side`). index -> address."""
        from dualrun.light.ports import server_port

        for index in indices:
            self._fixed[index] = server_port(self.endpoint.bind, self.avoid_ports | set(self._fixed.values()))
        self.side_by_side()
        return {i: f"{self._host_of(i)}:{self._fixed[i]}" for i in indices}

    def _host_of(self, index: int) -> str:
        """The host the trainers reach server `index` at."""
        return self.endpoint.advertised

    def start(self) -> dict[str, str]:
        """Start every server of this machine whose inputs are known, wait until all are healthy; role -> address
        of the servers known here.

        On any failure every server started so far is stopped and a LaunchError carries the log's tail."""
        try:
            for phase in at_launch(self.plan):   # the replicas, then their routers (spares: by a resize)
                self.start_now([i for i in phase if i in self.mine and self._inputs_known(i)])
        except ServerError as e:
            self.failed_start()
            raise LaunchError(str(e)) from None
        except BaseException:
            self.failed_start()
            raise
        self.addresses = addresses(self.plan, dict(self.started))   # a copy: another thread may add to it
        return self.addresses

    def _inputs_known(self, index: int) -> bool:
        """Whether the `index`-th server can start: a router once every replica of its unit runs (here or not)."""
        if self.plan.servers[index].kind != ROUTER:
            return True
        unit = self.plan.servers[index].unit
        return all(i in self.started for i, p in enumerate(self.plan.servers)
                   if p.unit == unit and p.kind != ROUTER and awaited(self.plan, i))

    def start_now(self, indices: list[int]) -> dict[int, str] | None:
        """Start these servers of this machine at once, wait until each is healthy; index -> address. ServerError
        when one fails; None when the set is being stopped (a server started meanwhile is stopped at once)."""
        with self._lock:
            if self.stopping:
                return None
            spawned = {i: self._spawn(i) for i in indices}
            self.running.update(spawned)
        try:
            for index in indices:
                spawned[index] = self._wait(index, spawned[index])
                self.started[index] = self._advertised[index]
        finally:
            if self.stopping:   # stopped meanwhile (the job ended): nothing started here may outlive it
                for server in spawned.values():
                    server.stop()
        if self.stopping:
            return None
        self.addresses = addresses(self.plan, dict(self.started))   # a copy: another thread may add to it
        return {i: self.started[i] for i in indices}

    def _wait(self, index: int, server: ServerProcess) -> ServerProcess:
        deadline = time.monotonic() + server.timeout_s
        for attempt in range(START_TRIES):
            try:
                server.wait_healthy(deadline)
                return server
            except ServerError as e:
                if not e.lost_port or attempt == START_TRIES - 1 or index in self._fixed:   # handed out: stays
                    raise
                server.stop()  # the free port was taken between picking and binding it: pick another
                server = self._spawn(index)
                self.running[index] = server
        return server

    def used(self) -> frozenset[str]:
        return frozenset(self._bound)

    def wiring_env(self) -> dict[str, str]:
        """The trainers' env for the addresses of every server known here (and, side by side, which to wait for)."""
        return {**self.wiring(self.addresses), **self.starting_env()}

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

    def _watch(self) -> None:
        def loop() -> None:
            while self.watching:
                self.check()
                self.supervisor.tick(time.monotonic())
                time.sleep(WATCH_EVERY_S)

        threading.Thread(target=loop, name="dualrun-server-watch", daemon=True).start()

    def _stop(self, grace_s: float) -> None:
        with self._lock:
            servers = list(self.running.values())
            self.running.clear()
        for server in servers:
            server.stop(grace_s)

    # -- the supervisor's primitives (supervisor.Replicas) ---------------------------------------------------
    def respawn(self, index: int, restart: int) -> str | None:
        """The replica's process again on its devices, on a fresh port (never the dead one's), healthy."""
        with self._lock:
            if self.stopping:
                return None
            dead = self.running.pop(index, None)   # ended: its output was drained by `wait_exit` (none: a spare)
            if index in self._advertised:
                self.avoid_ports.add(port_of(self._advertised[index]))
            self._fixed.pop(index, None)   # a port handed out at launch is the dead one's: a fresh one now
            self.running[index] = self._spawn(index)
        if dead is not None:
            dead.stop(0)   # the helpers its group may have left (vLLM's engine core)
        self._wait(index, self.running[index])
        return self._advertised[index]

    def alive(self, index: int) -> bool:
        server = self.running.get(index)
        return server is not None and server.alive()

    def kill(self, index: int, grace_s: float) -> tuple[str, str | None]:
        with self._lock:
            self._reported.add(index)   # its end is reported by the supervisor, as hung, not as an exit
            server = self.running.get(index)
        if server is None:   # the set was stopped meanwhile: it stopped the server too
            return "", None
        server.stop(grace_s)
        return server.tail(), server.log_path

    def rearm(self, index: int, address: str) -> bool:
        with self._lock:
            if self.stopping:
                return False
            self.started[index] = address
            self._reported.discard(index)   # its next death is an event too
        return True
