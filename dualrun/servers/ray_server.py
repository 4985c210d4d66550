"""Separate roles on Ray: each server runs from an actor in its own placement group, on any node.

A role with several engine replicas has one such actor per replica (each its own placement group, so each may
land on any node) and a CPU-only one for the router in front of them, started once the replicas are healthy.

Why an actor per server: it holds the role's bundle (Ray gives it the GPUs and sets CUDA_VISIBLE_DEVICES), so
the server's devices can never be a trainer's. Two phases, like the trainers' rendezvous: the actor reports its
node IP, GPUs and a free port on its node; the driver builds the command with the plugin (which stays on the
driver) and the actor starts it and waits for health there. The trainers then get `ip:port`. The server's output
reaches the driver's stderr as under torchrun, `[teacher server 0] ...`, by the long-poll the rank actors use
(light/line_queue.py), from its first line (while it loads) to its last; `log_dir` still gets all of it.

`RayServers` is the Ray implementation of the server-set interface (servers/serverset.py): the launcher starts
it, gives every rank its `wiring_env()`, watches it (one waiting call per server, resolved when the server ends,
becomes a `ServerDeath` event) and stops it with the job.

The actor module is imported by Ray worker processes: it needs only the standard library (and ray).
"""
from __future__ import annotations

import os
import sys
import tempfile
import threading
from typing import Any, Callable, Collection, Mapping

from dualrun.light.line_queue import STDERR, LineQueue
from dualrun.protocol import ActorPlace, ServerStart
from dualrun.servers.process import ServerError, ServerProcess
from dualrun.servers.serverset import START_TRIES, ServerDeath, ServerSet


class ServerActor:
    """One server on the actor's node. Threaded actor: `stop` may run while `start` still waits for health."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.server: ServerProcess | None = None
        self.output = LineQueue()   # the server's lines, `[label] ...`, for the driver's long-poll (`lines`)

    def where(self, avoid: list[int] | None = None) -> ActorPlace:
        import ray

        from dualrun.light.ports import free_port

        ip = ray.util.get_node_ip_address()
        port = free_port(ip, set(avoid or ()))
        return ActorPlace(ip, ray.get_runtime_context().get_node_id(), tuple(str(g) for g in ray.get_gpu_ids()),
                          os.getpid(), port)

    def start(self, argv: list[str], env: dict[str, str], host: str, port: int, health_path: str,
              timeout_s: float, log_path: str | None, cwd: str | None = None) -> ServerStart:
        """Start and wait for health; the outcome as a value (never an exception: it must cross Ray intact).

        `cwd`: the launching directory, as for the ranks, so a relative `model:` means what it means under
        torchrun (a Ray worker's own directory is Ray's session dir on a running cluster); on a node without that
        directory the server runs where Ray put it and only absolute paths work."""
        if log_path is None:
            log_path = os.path.join(tempfile.mkdtemp(prefix="dualrun-server-"), "server.log")
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        self.server = ServerProcess(self.label, argv, env, host, port, health_path, timeout_s, log_path,
                                    stream=_Lines(self.output), cwd=cwd if cwd and os.path.isdir(cwd) else None)
        try:
            self.server.start().wait_healthy()
        except ServerError as e:
            self.server.stop()   # its output stays open: a lost port is retried by this actor (`stop` closes it)
            return ServerStart(False, error=str(e), port_in_use=e.lost_port)
        return ServerStart(True, self.server.address, self.server.proc.pid if self.server.proc else None)

    def alive(self) -> bool:
        return self.server is not None and self.server.alive()

    def wait_exit(self) -> str:
        """Block until the server ends; the error naming it, its exit code and its log's last lines."""
        assert self.server is not None, "start() was not called"
        try:
            return str(self.server.wait_exit())   # its output read to the end
        finally:
            self.output.close()

    def lines(self, timeout: float = 5.0) -> list[tuple[int, str]] | None:
        """Long-poll: the server's queued output lines; None once it has ended."""
        return self.output.take(timeout)

    def stop(self, grace_s: float = 10.0) -> int | None:
        code = self.server.stop(grace_s) if self.server is not None else None
        self.output.close()
        return code


class _Lines:
    """The text stream ServerProcess tees the server's output to (one prefixed line per write): the queue."""

    def __init__(self, output: LineQueue) -> None:
        self.output = output

    def write(self, text: str) -> None:
        self.output.put(STDERR, text.rstrip("\n"))

    def flush(self) -> None:
        pass


class RayServers(ServerSet):
    """The plan's servers on a connected Ray cluster: placement groups, actors, health, addresses, teardown."""

    def __init__(self, cfg: Any, plugin: Any, plan: Any, run_id: str,
                 env_for: Callable[[Any], dict[str, str]], bundle: Callable[[Any], dict[str, float]],
                 check: Callable[[], None] = lambda: None, attempt: int = 0,
                 avoid: Collection[str] = ()) -> None:
        super().__init__(plan)
        self.cfg, self.plugin, self.run_id = cfg, plugin, run_id
        self.env_for, self.bundle, self.check, self.attempt = env_for, bundle, check, attempt
        self.avoid = set(avoid)   # `ip:port` of an earlier set's servers: a restart never reuses them
        from dualrun.raycluster import Gang

        self.gang = Gang(cfg.ray, cfg.source, check)   # the servers' placement groups and actors
        self.infos: list[ActorPlace | None] = []
        self._exits: dict[Any, int] = {}   # ref that resolves when a server ends -> its plan.servers index
        self._printer: threading.Thread | None = None
        self._printed = threading.Event()   # the printer's end: set once the servers' last lines are out
        self._watcher: threading.Thread | None = None

    def start(self) -> dict[str, str]:
        """Place, start and health-check every server (all at once); role -> `ip:port`. Stops all on failure."""
        from dualrun.errors import LaunchError

        if not self.plan.servers:
            return self.addresses
        from ray.exceptions import RayError

        try:
            self._place()
            self._print_output()
            started = self._start_all()
        except RayError as e:
            self.stop()
            raise LaunchError(f"a separate role's server actor failed: {str(e).strip().splitlines()[0][:200]}")
        except BaseException:   # a signal (the check) or anything else: nothing is left behind, quickly
            self.stop(grace_s=3.0)
            raise
        from dualrun.servers.planned import addresses

        self.addresses = addresses(self.plan, started)
        # one waiting call per server for the whole job: the watcher turns each that resolves into an event
        self._exits = {a.wait_exit.remote(): i for i, a in enumerate(self.actors)}
        return self.addresses

    @property
    def actors(self) -> list[Any]:
        """One ServerActor per planned server, in plan order."""
        return self.gang.actors

    @property
    def pgs(self) -> list[Any]:
        return self.gang.pgs

    def _place(self) -> None:
        import ray

        cls = ray.remote(ServerActor)
        for p in self.plan.servers:
            b = self.bundle(p)
            name = f"{self.run_id}-{p.label.replace(' ', '-')}-{self.attempt}"   # a replica's, or the router's
            pg = self.gang.place(name, p.roles[0], [b], what="server(s)")
            self.gang.spawn(cls, pg, 0, p.label, num_cpus=b.get("CPU", 0), num_gpus=b.get("GPU", 0),
                            max_concurrency=6, max_restarts=0, name=name)

    def _print_output(self) -> None:
        """A thread that prints every server's lines on this driver's stderr as they come (under torchrun the
        servers' own tee does), until each has ended or `stop` is called."""
        import ray
        from ray.exceptions import RayError

        actors, stopping, stream = list(self.actors), self._printed, sys.stderr

        def run() -> None:
            pending = {a.lines.remote(): a for a in actors}
            while pending and not stopping.is_set():
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
                for ref in ready:
                    actor = pending.pop(ref)
                    try:
                        batch = ray.get(ref)
                    except RayError:   # the actor is gone (stopped, or died: the watch names it)
                        continue
                    if batch is None:
                        continue
                    if batch:
                        stream.write("".join(text + "\n" for _, text in batch))
                        stream.flush()
                    pending[actor.lines.remote()] = actor

        self._printer = threading.Thread(target=run, name="dualrun-server-output", daemon=True)
        self._printer.start()

    def _start_all(self) -> dict[int, str]:
        """Every engine replica at once, then the routers in front of them (they need the replicas' addresses)."""
        from dualrun.servers.planned import phases

        started: dict[int, str] = {}
        self.infos = [None for _ in self.plan.servers]
        for phase in phases(self.plan):
            started.update(self._start_phase(phase, started))
        return started

    def _start_phase(self, todo: list[int], started: Mapping[int, str]) -> dict[int, str]:
        from dualrun.errors import LaunchError
        from dualrun.raycluster import wait_refs
        from dualrun.servers.planned import (log_name, replica_addresses, server_command, server_health_path,
                                             server_role)

        done: dict[int, str] = {}
        for attempt in range(START_TRIES):
            ports = sorted(int(a.rpartition(":")[2]) for a in self.avoid)
            infos = wait_refs([self.actors[i].where.remote(ports) for i in todo], "start their server actors",
                              max(60.0, self.cfg.ray.placement_timeout_s), self.check)
            refs = {}
            for i, info in zip(todo, infos):
                self.infos[i] = info
                p = self.plan.servers[i]
                role = server_role(self.cfg, p)
                argv = server_command(self.cfg, self.plugin, p, info.ip, info.port,
                                      replica_addresses(self.plan, started, i))
                env = dict(self.env_for(p))
                env["CUDA_VISIBLE_DEVICES"] = ",".join(info.gpus)
                log = os.path.abspath(os.path.join(self.cfg.log_dir, log_name(p))) if self.cfg.log_dir else None
                refs[i] = self.actors[i].start.remote(argv, env, info.ip, info.port,
                                                      server_health_path(self.plugin, role, p),
                                                      role.health_timeout_s, log, os.getcwd())
            retry = []
            limit = max(server_role(self.cfg, self.plan.servers[i]).health_timeout_s for i in refs) + 30.0
            results = wait_refs(list(refs.values()), "get their servers healthy", limit, self.check)
            for i, result in zip(refs, results):
                if result.ok:
                    done[i] = result.address
                elif result.port_in_use and attempt < START_TRIES - 1:
                    retry.append(i)
                else:
                    raise LaunchError(result.error)
            if not retry:
                return done
            todo = retry
        return done

    def why_ended(self, ref: Any) -> ServerDeath:
        """For a server-exit ref that resolved: the event naming the server, its exit code and log's last lines."""
        import ray
        from ray.exceptions import RayError

        index = self._exits.get(ref)
        label = self.plan.servers[index].label if index is not None else "a server"
        try:
            text = ray.get(ref)
        except RayError as e:
            lines = [ln for ln in str(e).strip().splitlines() if ln.strip()] or [type(e).__name__]
            text = f"{label}: its Ray actor died ({lines[0][:200]})"
        return ServerDeath(index, label, text, text.splitlines()[0])

    def _watch(self) -> None:
        """A thread that waits on every server's exit ref and reports each that resolves."""
        import ray

        def run() -> None:
            pending = list(self._exits)
            while pending and self.watching:
                ready, pending = ray.wait(pending, num_returns=1, timeout=0.25)
                for ref in ready:
                    if self.watching:
                        self.report(self.why_ended(ref))

        if self._exits:
            self._watcher = threading.Thread(target=run, name="dualrun-server-watch", daemon=True)
            self._watcher.start()

    def used(self) -> frozenset[str]:
        """`ip:port` of every server this set started (a restart avoids them)."""
        return frozenset(info.address for info in self.infos if info)

    def wiring_env(self) -> dict[str, str]:
        from dualrun.servers.planned import wiring_env

        return wiring_env(self.cfg, self.plugin, self.addresses)

    def server_devices(self) -> Mapping[str, list[str]]:
        """label -> the GPU ids Ray gave each server (what tests compare with the trainers')."""
        return {p.label: list(info.gpus) for p, info in zip(self.plan.servers, self.infos) if info}

    def _stop(self, grace_s: float) -> None:
        """Stop every server, kill its actor, remove its placement group."""
        self.gang.call_all("stop", grace_s, timeout=grace_s + 5)
        if self._printer is not None:   # the servers' last lines (they have ended), then no more calls to them
            self._printer.join(timeout=2.0)
            self._printed.set()
            self._printer.join(timeout=2.0)
            self._printer = None
        if self._watcher is not None:
            self._watcher.join(timeout=2.0)
            self._watcher = None
        self.gang.stop()
        self._exits = {}
