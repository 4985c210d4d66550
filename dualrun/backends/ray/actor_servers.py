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
server on a fresh port. A fleet's spare replicas (`Serving.spare`) get neither at launch: a resize, or room that
appears in the cluster (fleet_follow.py), places and starts one on any node with room; one resized away, or whose
node left, gives back its actor and its group (`kill`).

The actor itself (`ServerActor`) lives in actors/server_actor.py: Ray worker processes import only that.
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
from dualrun.backends.ray.actors.server_actor import ServerActor
from dualrun.backends.ray.actor_replicas import ActorReplicas
from dualrun.servers.planned import spare
from dualrun.servers.serverset import START_TRIES, ServerDeath, ServerSetBase
from dualrun.servers.supervisor import Supervisor


def on_this_host(plan: Any) -> bool:
    """Every node of the cluster is this machine (one address, one of this machine's): the job's servers, its
    trainers and this driver all reach loopback. A cluster joined through `ray://` from elsewhere is not."""
    from dualrun.light.interfaces import interfaces

    nodes = {n.address for n in plan.cluster.nodes}
    here = {i.address for i in interfaces().values() if i.address} | {"127.0.0.1"}
    return len(nodes) == 1 and nodes <= here and not grows_elsewhere(plan)


def grows_elsewhere(plan: Any) -> bool:
    """A fleet with spares on a cluster that other machines can join (a node with an address off loopback): a spare
    may start on a node that joins after launch (fleet_follow.py), which must reach the router and the weight-sync
    group and be reached, so the job cannot count on one host even while the cluster has one node. An embedded
    cluster (bound to 127.0.0.1) keeps every spare on this machine."""
    spares = any(p.serving is not None and p.serving.spare for p in plan.servers)
    return spares and any(not n.address.startswith("127.") for n in plan.cluster.nodes)


class RayServers(ActorReplicas, ServerSetBase):
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
        self._joins = 0   # spares started so far (each actor's name is its own)
        from dualrun.backends.ray.fleet_follow import Follower

        self.follower = Follower(self)   # the fleets grow onto room the cluster gets

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
            if actor is not None:   # (a spare: none until it starts)
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
            pg, actor = (None, None) if spare(p) else self._place_one(self.gang, index, self.bundle(p),
                                                                      self._name(index))
            self._pg_of.append(pg)
            self._actors.append(actor)

    def _place_one(self, gang: Any, index: int, b: dict[str, float], name: str, pg: Any = None,
                   precheck: bool = True) -> tuple[Any, Any]:
        """A server's own placement group (a replica's, or the router's; `pg`: one placed already, now the
        gang's) and its actor in it."""
        import ray

        p = self.plan.servers[index]
        if pg is None:
            pg = gang.place(name, p.roles[0], [b], what="server(s)", precheck=precheck)
        else:
            gang.pgs.append(pg)
        actor = gang.spawn(ray.remote(ServerActor), pg, 0, p.label, num_cpus=b.get("CPU", 0),
                           num_gpus=b.get("GPU", 0), max_concurrency=6, max_restarts=0, name=name)
        return pg, actor

    def _print_output(self) -> None:
        """The servers' lines on this driver's stderr as they come (server_output.py)."""
        from dualrun.backends.ray.server_output import print_output

        self._printer = print_output([a for a in self.actors if a is not None], lambda: self.stopping, self._printed,
                                     self._new_output)

    def _start_all(self) -> dict[int, str]:
        """Every engine replica at once, then the routers in front of them (they need the replicas' addresses)."""
        from dualrun.servers.planned import at_launch

        started: dict[int, str] = {}
        self.infos = [None for _ in self.plan.servers]
        for phase in at_launch(self.plan):   # (the spares: by a resize, or when the cluster has room)
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
            from dualrun.backends.ray.fleet_follow import gone

            lines = [ln for ln in str(e).strip().splitlines() if ln.strip()] or [type(e).__name__]
            info = self.infos[index] if index is not None and index < len(self.infos) else None
            where = f" on node {info.ip}" if info else ""   # a lost node: the machine named
            if info is not None and gone(info.node_id, ray.nodes(), str(e)):
                text = f"{label}: its node {info.ip} ({info.node_id[:8]}) left the cluster ({lines[0][:200]})"
                return ServerDeath(index, label, text, text, node_gone=True)
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
            self.follower.start()

    def scale(self, role: str, replicas: int) -> str:
        """`dualrun scale`: the role's target from now on (fleet_follow.py grows it when room appears), then the
        resize at once (`ServerSetBase.scale`): a shrink, or a grow where the cluster has room within
        `ray.placement_timeout_s`."""
        fleet = self.plan.fleets.get(role)
        if fleet is not None and fleet.resizable and fleet.low <= replicas <= fleet.high:
            self.follower.set_target(role, replicas)
        return super().scale(role, replicas)

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
        self.follower.stop()   # the pending groups: nothing grows any more
        call_each([a for a in self.actors if a is not None and id(a) not in restarting], "stop", grace_s,
                  timeout=grace_s + 5)
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
