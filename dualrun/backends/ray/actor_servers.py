"""Separate roles on Ray: each server runs from an actor in its own placement group, on any node.

A role with several engine replicas has one such actor per replica (each its own placement group, so each may
land on any node) and a CPU-only one for the router in front of them, started once the replicas are healthy.

Why an actor per server: it holds the role's bundle (Ray gives it the GPUs and sets CUDA_VISIBLE_DEVICES), so
the server's devices can never be a trainer's. Two phases, like the trainers' rendezvous: the actor reports its
node IP, GPUs and a free port on its node; the driver fills them into the plan's command (plan/servers.py: the
method built it, on the driver) and the actor starts it and waits for health there. The trainers then get `ip:port`. The server's output
reaches the driver's stderr as under torchrun, `[teacher server 0] ...`, by the long-poll the rank actors use
(light/line_queue.py), from its first line (while it loads) to its last; `log_dir` still gets all of it.

`RayServers` is the Ray implementation of the server-set interface (servers/serverset.py): the launcher starts
it, gives every rank its `wiring_env()`, watches it (one waiting call per server, resolved when the server ends,
becomes a `ServerDeath` event; the supervisor asks the routers about hung replicas once a second) and stops it
with the job. A dead or hung replica that the job survives losing is restarted by the set's supervisor
(supervisor.py): here its actor and placement group are replaced by fresh ones on the same node (`respawn`), the
server on a fresh port.

The actor itself (`ServerActor`) lives in ray_actor.py: Ray worker processes import only that.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import threading
import time
from typing import Any, Callable, Collection, Iterator, Mapping

from dualrun.contract.protocol import ActorPlace
from dualrun.light.interfaces import ifname_set
from dualrun.servers.process import ServerError
from dualrun.backends.ray.actors.server_actor import ServerActor
from dualrun.servers.serverset import START_TRIES, ServerDeath, ServerSetBase
from dualrun.servers.supervisor import Supervisor


def on_this_host(plan: Any) -> bool:
    """Every node of the cluster is this machine (one address, one of this machine's): the job's servers, its
    trainers and this driver all reach loopback. A cluster joined through `ray://` from elsewhere is not."""
    from dualrun.light.interfaces import interfaces

    nodes = {n.address for n in plan.cluster.nodes}
    here = {i.address for i in interfaces().values() if i.address} | {"127.0.0.1"}
    return len(nodes) == 1 and nodes <= here


class RayServers(ServerSetBase):
    """The plan's servers on a connected Ray cluster: placement groups, actors, health, addresses, teardown.

    From the launcher: `env_for` (a server's env), `wiring` (the trainers' env for the addresses), `bundle` (a
    server's resources), `gang` (a `backends.ray.cluster.Gang` on the job's cluster, given the check it calls while it
    waits), `wait_s` (how long placing and starting the actors may take), `check` (raises to interrupt a wait)."""

    def __init__(self, plan: Any, run_id: str, env_for: Callable[[Any], dict[str, str]],
                 wiring: Callable[[Mapping[str, str]], dict[str, str]], bundle: Callable[[Any], dict[str, float]],
                 gang: Callable[[Callable[[], None]], Any], wait_s: float = 60.0,
                 check: Callable[[], None] = lambda: None, attempt: int = 0, avoid: Collection[str] = ()) -> None:
        super().__init__(plan)
        self.loopback = on_this_host(plan)   # every server listens on loopback alone, and is reached there
        self.run_id, self.env_for, self.wiring, self.bundle = run_id, env_for, wiring, bundle
        self.new_gang, self.wait_s, self.check, self.attempt = gang, wait_s, check, attempt
        self.avoid = set(avoid)   # `ip:port` of an earlier set's servers (and of dead replicas): never reused
        self.gang = gang(check)   # the servers' placement groups and actors
        self._gangs = [self.gang]                       # ... and one more per restarted replica
        self._actors: list[Any] = []                    # plan order: each server's current actor
        self._pg_of: list[Any] = []                     # plan order: its placement group
        self.infos: list[ActorPlace | None] = []
        self._reserved: dict[int, ActorPlace] = {}   # `reserve`: index -> its actor's place and handed-out port
        self._ports: dict[int, int] = {}            # ... on loopback: index -> the port picked here
        self._used: set[str] = set()
        self._exits: dict[Any, int] = {}   # ref that resolves when a server ends -> its plan.servers index
        self._exit_of: dict[int, Any] = {}  # ... and back
        self._new_exits: "queue.Queue[Any]" = queue.Queue()    # a restarted replica's, for the watcher
        self._new_output: "queue.Queue[Any]" = queue.Queue()   # a restarted replica's actor, for the printer
        self._lock = threading.Lock()       # the actors and groups, between a restart's thread and `stop`
        self._printer: threading.Thread | None = None
        self._printed = threading.Event()   # the printer's end: set once the servers' last lines are out
        self._watcher: threading.Thread | None = None
        self.supervisor = Supervisor(plan, self, self, lambda index: self.started.get(index))

    def reserve(self) -> dict[str, str] | None:
        """Side by side: every server's actor placed and the port of each server the trainers talk to picked on
        its node (`server_port`; on one host by the driver); role -> `ip:port`. Stops all on failure."""
        from dualrun.servers.planned import addresses, facing

        if not self.plan.servers:
            return None
        from dualrun.backends.ray.cluster import wait_refs

        with self._failing(self.stop):
            self._place()
            self._print_output()
            handed = facing(self.plan)
            avoid = sorted(int(a.rpartition(":")[2]) for a in self.avoid)
            if self.loopback:   # every node is this machine: its port is picked here, no actor waited for
                from dualrun.light.ports import server_port

                self._ports = {i: server_port("127.0.0.1", avoid) for i in handed}
                infos = []
            else:
                infos = wait_refs([self.actors[i].where.remote(avoid, True) for i in handed],
                                  "start their server actors", self.wait_s, self.check)
        self._reserved = dict(zip(handed, infos))
        self.side_by_side()
        handed_out = {i: f"{self._host(info)}:{info.port}" for i, info in self._reserved.items()}
        handed_out.update({i: f"127.0.0.1:{port}" for i, port in self._ports.items()})
        self.addresses = addresses(self.plan, handed_out)
        return self.addresses

    @contextlib.contextmanager
    def _failing(self, stop: Callable[..., None]) -> Iterator[None]:
        """A Ray error inside is the job's LaunchError naming the server actor; any failure `stop`s what was started
        (quickly for a signal: nothing is left behind)."""
        from ray.exceptions import RayError

        from dualrun.contract.errors import LaunchError

        try:
            yield
        except RayError as e:
            stop()
            raise LaunchError(f"a separate role's server actor failed: {str(e).strip().splitlines()[0][:200]}")
        except BaseException:
            stop(grace_s=3.0)
            raise

    def _handed_out(self, index: int) -> bool:
        """Whether the trainers were given server `index`'s port (`reserve`): it is never moved."""
        return index in self._reserved or index in self._ports

    def _host(self, info: ActorPlace) -> str:
        """The host a server on `info`'s node listens and is reached at."""
        return "127.0.0.1" if self.loopback else info.ip

    def start(self) -> dict[str, str]:
        """Place (unless `reserve` did), start and health-check every server (all at once); role -> `ip:port`.
        Stops all on failure (side by side: the launcher does, as the job ends)."""
        if not self.plan.servers:
            return self.addresses
        with self._failing(self.failed_start):
            if not self._actors:
                self._place()
                self._print_output()
            self.started = self._start_all()
        from dualrun.servers.planned import addresses

        self.addresses = addresses(self.plan, self.started)
        # one waiting call per server: the watcher turns each that resolves into an event
        for index, actor in enumerate(self.actors):
            self._exit_ref(index, actor)
        return self.addresses

    @property
    def actors(self) -> list[Any]:
        """One ServerActor per planned server, in plan order (a restarted replica's: its fresh one)."""
        return self._actors

    @property
    def pgs(self) -> list[Any]:
        return [pg for gang in self._gangs for pg in gang.pgs]

    def _name(self, index: int, restart: int = 0) -> str:
        label = self.plan.servers[index].label.replace(" ", "-")
        return f"{self.run_id}-{label}-{self.attempt}" + (f"-r{restart}" if restart else "")

    def _place(self) -> None:
        for index, p in enumerate(self.plan.servers):
            pg, actor = self._place_one(self.gang, index, self.bundle(p), self._name(index))
            self._pg_of.append(pg)
            self._actors.append(actor)

    def _place_one(self, gang: Any, index: int, b: dict[str, float], name: str) -> tuple[Any, Any]:
        """A server's own placement group (a replica's, or the router's) and its actor in it."""
        import ray

        p = self.plan.servers[index]
        pg = gang.place(name, p.roles[0], [b], what="server(s)")
        actor = gang.spawn(ray.remote(ServerActor), pg, 0, p.label, num_cpus=b.get("CPU", 0),
                           num_gpus=b.get("GPU", 0), max_concurrency=6, max_restarts=0, name=name)
        return pg, actor

    def _print_output(self) -> None:
        """The servers' lines on this driver's stderr as they come (server_output.py)."""
        from dualrun.backends.ray.server_output import print_output

        self._printer = print_output(list(self.actors), lambda: self.stopping, self._printed, self._new_output)

    def _start_all(self) -> dict[int, str]:
        """Every engine replica at once, then the routers in front of them (they need the replicas' addresses)."""
        from dualrun.servers.planned import phases

        started: dict[int, str] = {}
        self.infos = [None for _ in self.plan.servers]
        for phase in phases(self.plan):
            started.update(self._start_phase(phase, started))
        return started

    def _start_phase(self, todo: list[int], started: Mapping[int, str],
                     check: Callable[[], None] | None = None) -> dict[int, str]:
        """Start the servers `todo` (their actors placed), each on a free port of its node; index -> address.
        A port taken between picking and binding it is picked again; any other failure: LaunchError."""
        from dualrun.contract.errors import LaunchError
        from dualrun.backends.ray.cluster import wait_refs

        check = check or self.check
        done: dict[int, str] = {}
        for attempt in range(START_TRIES):
            ports = sorted(int(a.rpartition(":")[2]) for a in self.avoid)
            fresh = [i for i in todo if i not in self._reserved]   # a reserved port was handed out: it stays
            infos = dict(zip(fresh, wait_refs([self.actors[i].where.remote(ports) for i in fresh],
                                              "start their server actors", self.wait_s, check)))
            infos.update({i: self._reserved[i] for i in todo if i in self._reserved})
            infos.update({i: dataclasses.replace(infos[i], port=self._ports[i]) for i in todo if i in self._ports})
            refs = {i: self._start_call(i, infos[i], started) for i in todo}
            retry = []
            limit = max(self.plan.servers[i].serving.health_timeout_s for i in refs) + 30.0
            results = wait_refs(list(refs.values()), "get their servers healthy", limit, check)
            for i, result in zip(refs, results):
                if result.ok:
                    done[i] = result.address
                elif result.port_in_use and attempt < START_TRIES - 1 and not self._handed_out(i):
                    retry.append(i)
                else:
                    raise LaunchError(result.error)
            if not retry:
                return done
            todo = retry
        return done

    def _start_call(self, i: int, info: ActorPlace, started: Mapping[int, str]) -> Any:
        """Server `i`'s command (the plan's, for `info`'s address) started by its actor: the ref of its
        `ServerStart`."""
        from dualrun.servers.planned import replica_addresses

        self.infos[i] = info
        self._used.add(info.address)
        p = self.plan.servers[i]
        serving = p.serving
        host = self._host(info)
        argv = serving.argv(host, info.port, replica_addresses(self.plan, started, i))
        env = dict(self.env_for(p))
        env["CUDA_VISIBLE_DEVICES"] = ",".join(info.gpus)
        if self.plan.cluster.addresses() > 1 and info.interface and not ifname_set(env):
            env["GLOO_SOCKET_IFNAME"] = info.interface   # as the ranks get it (backends/ray/actor_launcher.py): the weight sync
        log = os.path.abspath(serving.log_path) if serving.log_path else None
        return self.actors[i].start.remote(argv, env, host, info.port, serving.health_path,
                                           serving.health_timeout_s, log, os.getcwd())

    def _exit_ref(self, index: int, actor: Any) -> None:
        """The waiting call that resolves when server `index` ends; the watcher reports it."""
        ref = actor.wait_exit.remote()
        self._exits[ref] = index
        self._exit_of[index] = ref
        self._new_exits.put(ref)

    def why_ended(self, ref: Any, index: int | None = None) -> ServerDeath:
        """For a server-exit ref that resolved: the event naming the server, its exit code and log's last lines."""
        import ray
        from ray.exceptions import RayError

        index = self._exits.get(ref) if index is None else index
        label = self.plan.servers[index].label if index is not None else "a server"
        try:
            text = ray.get(ref)
        except RayError as e:
            lines = [ln for ln in str(e).strip().splitlines() if ln.strip()] or [type(e).__name__]
            info = self.infos[index] if index is not None and index < len(self.infos) else None
            where = f" on node {info.ip}" if info else ""   # a lost node: the machine named
            text = f"{label}: its Ray actor{where} died ({lines[0][:200]})"
        return ServerDeath(index, label, text, text.splitlines()[0])

    def _watch(self) -> None:
        """A thread that waits on every server's exit ref and reports each that resolves (a replaced server's
        no longer counts), and lets the supervisor look for hung replicas."""
        import ray

        def run() -> None:
            pending: list[Any] = []
            while self.watching:
                while not self._new_exits.empty():
                    pending.append(self._new_exits.get())
                if pending:
                    ready, pending = ray.wait(pending, num_returns=1, timeout=0.25)
                else:
                    ready = []
                    time.sleep(0.25)
                for ref in ready:
                    index = self._exits.pop(ref, None)
                    if index is not None and self.watching:
                        self.report(self.why_ended(ref, index))
                self.supervisor.tick(time.monotonic())

        if self._exits:
            self._watcher = threading.Thread(target=run, name="dualrun-server-watch", daemon=True)
            self._watcher.start()

    # -- the supervisor's primitives (supervisor.Replicas) ---------------------------------------------------
    def respawn(self, index: int, restart: int) -> str | None:
        """A fresh actor in a fresh placement group on the dead replica's node (its old group removed first, so
        the node's resources it held are free: Ray gives the new one the same shape there), the server on a fresh
        port, healthy. ServerError naming the replica when any step fails."""
        from dualrun.contract.errors import LaunchError

        label = self.plan.servers[index].label

        def check() -> None:
            if self.stopping:
                raise ServerError(label, "was being restarted when the job ended")

        with self._lock:
            if self.stopping:
                return None
            old_actor, old_pg, info = self._actors[index], self._pg_of[index], self.infos[index]
            gang = self.new_gang(check)
            self._gangs.append(gang)
        assert info is not None
        self.avoid.add(info.address)   # a fresh port, never the dead one's
        try:   # the helpers its process group may have left (vLLM's engine core), before the actor goes
            import ray

            ray.get(old_actor.stop.remote(0), timeout=10)
        except Exception:  # noqa: BLE001 - a dead actor: nothing of it to stop
            pass
        for held in list(self._gangs):   # the first set's gang, or an earlier restart's
            held.drop(old_actor, old_pg)
        bundle = dict(self.bundle(self.plan.servers[index]), **{f"node:{info.ip}": 0.001})   # the same node
        try:
            pg, actor = self._place_one(gang, index, bundle, self._name(index, restart))
            with self._lock:
                if self.stopping:
                    gang.stop()
                    return None
                self._pg_of[index], self._actors[index] = pg, actor
            self._new_output.put(actor)
            address = self._start_phase([index], self.started, check)[index]
        except ServerError:
            raise
        except LaunchError as e:
            raise ServerError(label, "could not be restarted: " + str(e).splitlines()[0].removeprefix(label + " ")) \
                from None
        except Exception as e:  # noqa: BLE001 - a Ray error on the way: the job ends naming the replica
            raise ServerError(label, f"could not be restarted: {str(e).strip().splitlines()[0][:200]}") from None
        return address

    def rearm(self, index: int, address: str) -> bool:
        with self._lock:
            if self.stopping:
                return False
            self.started[index] = address
            self._exit_ref(index, self._actors[index])   # its next death is an event too
        return True

    def alive(self, index: int) -> bool:
        import ray
        from ray.exceptions import GetTimeoutError, RayError

        try:
            return bool(ray.get(self._actors[index].alive.remote(), timeout=5.0))
        except (RayError, GetTimeoutError):
            return False

    def kill(self, index: int, grace_s: float) -> tuple[str, str | None]:
        import ray
        from ray.exceptions import GetTimeoutError, RayError

        self._exits.pop(self._exit_of.pop(index, None), None)   # its end is reported by the supervisor, as hung
        actor = self._actors[index]
        try:
            ray.get(actor.stop.remote(grace_s), timeout=grace_s + 10.0)
            return ray.get(actor.tail.remote(), timeout=10.0)
        except (RayError, GetTimeoutError):
            return "", None

    # -- the rest of the interface ---------------------------------------------------------------------------
    def used(self) -> frozenset[str]:
        """`ip:port` of every server this set started (a restart avoids them)."""
        return frozenset(self._used)

    def wiring_env(self) -> dict[str, str]:
        return {**self.wiring(self.addresses), **self.starting_env()}

    def server_devices(self) -> Mapping[str, list[str]]:
        """label -> the GPU ids Ray gave each server (what tests compare with the trainers')."""
        return {p.label: list(info.gpus) for p, info in zip(self.plan.servers, self.infos) if info}

    def _stop(self, grace_s: float) -> None:
        """Stop every server, kill its actor, remove its placement group (a restart's too).

        A replica being restarted is not asked to stop: its fresh actor may still be starting (a new Ray worker
        process: 10 s and more on a loaded machine, measured), and a call to it waits for that. Its actor is killed
        with the others below; a server it had started gets SIGTERM from its parent's death (process.py)."""
        from dualrun.backends.ray.gang import call_each

        with self._lock:
            restarting = {id(self._actors[i]) for i in self.supervisor.restarting if i < len(self._actors)}
        call_each([a for a in self.actors if id(a) not in restarting], "stop", grace_s, timeout=grace_s + 5)
        if self._printer is not None:   # the servers' last lines (they have ended), then no more calls to them
            self._printer.join(timeout=2.0)
            self._printed.set()
            self._printer.join(timeout=2.0)
            self._printer = None
        if self._watcher is not None:
            self._watcher.join(timeout=2.0)
            self._watcher = None
        with self._lock:   # a restart placing a group meanwhile sees `stopping` and removes its own
            for gang in self._gangs:
                gang.stop()
            self._gangs = [self.gang]
            self._actors, self._pg_of = [], []
        self._exits = {}
