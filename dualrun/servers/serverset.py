"""The interface of a job's server set, on either backend: start, addresses, wiring, events of a dying server, stop.

Why one interface: both launchers run the plan's servers the same way (start them beside the trainers, hand the
trainers their wiring, end or restart the job when one dies, stop them with the job) whether they run as
processes here (`LocalServers`, local.py; several torchrun machines: `Machines`,
backends/torchrun/machine_servers.py, around it) or from Ray actors (`RayServers`, backends/ray/actor_servers.py).
A dying server is an event (`ServerDeath`, naming which of `plan.servers` it was)
that the launcher takes from `next_death`; the set's own watcher (a thread polling its processes, or one waiting
on its actors) reports it, and the set's supervisor (supervisor.py) restarts a replica the job survives losing;
only the deaths it does not survive reach `next_death`.
"""
from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Mapping, Protocol

from dualrun.servers.server_death import ServerDeath

if TYPE_CHECKING:
    from dualrun.servers.supervisor import Supervisor

START_MARGIN_S = 60.0   # a rank waits this much longer than the launcher for a server starting beside it
START_TRIES = 3   # a server whose free port was taken between picking and binding it is started again, this often


class ServerSet(Protocol):
    """What a launcher does with a job's servers (a set is started once; a restart with fresh servers is a new set).

    `addresses`: role -> `host:port` once started (user-run servers, `address:`, from the start). `failure`: the
    first death the job does not survive, kept."""

    plan: Any
    addresses: dict[str, str]
    failure: ServerDeath | None

    def start(self) -> dict[str, str]:
        """Start every server (all of a phase at once), wait until each is healthy; role -> address. On failure
        every server started so far is stopped and a LaunchError names the server and quotes its log."""

    def reserve(self) -> dict[str, str] | None:
        """Fix the address of every server the trainers talk to (a lone server, a router) before `start`, so that
        the trainers can start beside the servers (side by side); role -> address. None: this set cannot (its
        addresses are known only once its servers answer): the launcher starts the servers first."""

    def wiring_env(self) -> dict[str, str]:
        """Env for the trainer ranks: the method's wiring of the servers' addresses."""

    def used(self) -> frozenset[str]:
        """`host:port` of every endpoint this set bound: the next set (a restart) never reuses one."""

    def watch(self) -> None:
        """While the job runs: report each server that ends, as a `ServerDeath` (`next_death`)."""

    def unwatch(self) -> None:
        """The job's ranks are done: the servers may end now without it being an event."""

    @property
    def watching(self) -> bool: ...

    @property
    def stopping(self) -> bool: ...

    def next_death(self, timeout: float = 0.0) -> ServerDeath | None:
        """The next death the job does not survive, waiting up to `timeout` s for one; None if none came."""

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop every server (idempotent); on success, failure and interruption alike."""


class ServerSetBase(ABC):
    """The events and flags both backends' sets share, and their supervisor: a backend implements `start`,
    `wiring_env`, `used`, `_watch` (its watcher calls `report`) and `_stop`. The watcher runs only while the set is
    watched (`watch` .. `unwatch`), and nothing is reported once `stop` began, so the servers' normal end is no
    event."""

    def __init__(self, plan: Any) -> None:
        self.plan = plan
        self.addresses: dict[str, str] = dict(plan.external)
        self.failure: ServerDeath | None = None
        self.started: dict[int, str] = {}   # plan.servers index -> address of its serving process (here or not)
        self.supervisor: "Supervisor | None" = None   # restarts the replicas the job survives losing
        self._deaths: "queue.Queue[ServerDeath]" = queue.Queue()
        self._watching = threading.Event()
        self._stopping = threading.Event()   # the set's one stop flag: set when `stop` begins
        self._ready = threading.Event()      # every server answered: the watcher may run (cleared by `reserve`)
        self._ready.set()
        self._begun = False                  # the watcher began (once)
        self._begin_lock = threading.Lock()
        self.start_error: Exception | None = None   # side by side: why the servers never all answered

    @abstractmethod
    def start(self) -> dict[str, str]:
        """ServerSet.start."""

    def reserve(self) -> dict[str, str] | None:
        """ServerSet.reserve: None unless the backend fixes its addresses before starting (its own `reserve`
        then calls `side_by_side`)."""
        return None

    def starting_env(self, at: "Mapping[str, str] | None" = None) -> dict[str, str]:
        """For the trainers while the servers start beside them: which addresses to wait for where they first
        connect (role -> address: `at`, else the set's), and how long (dualrun/rank/server_wait.py); nothing once
        they all answer."""
        import json

        from dualrun.contract.protocol import SERVERS_STARTING

        if self._ready.is_set():
            return {}
        at = self.addresses if at is None else at
        servers = {addr: role for role, addr in at.items() if role not in self.plan.external}
        wait_s = max((p.serving.health_timeout_s for p in self.plan.servers if p.serving is not None), default=0.0)
        health = {addr: self._health_path(role) for addr, role in servers.items()}   # rank/server_cores.py's check
        return {SERVERS_STARTING: json.dumps({"servers": servers, "wait_s": wait_s + START_MARGIN_S,
                                              "health": health})}

    def _health_path(self, role: str) -> str:
        """The health path of what answers at `role`'s address: its router where it has one, else its server."""
        from dualrun.plan.servers import ROUTER

        procs = [p for p in self.plan.servers if role in getattr(p, "roles", ()) and p.serving is not None]
        procs.sort(key=lambda p: p.kind != ROUTER)
        return procs[0].serving.health_path if procs else "/health"

    def failed_start(self, grace_s: float = 10.0) -> None:
        """A start that failed stops the set; side by side the set stays up to the job's end (which this failure
        causes: `not_started`) and the launcher stops it there."""
        if self._ready.is_set():
            self.stop(grace_s)

    def side_by_side(self) -> None:
        """The set will start beside the trainers: its watcher waits for `started_all`."""
        self._ready.clear()

    @abstractmethod
    def wiring_env(self) -> dict[str, str]:
        """ServerSet.wiring_env."""

    @abstractmethod
    def used(self) -> frozenset[str]:
        """ServerSet.used."""

    @abstractmethod
    def _watch(self) -> None:
        """Begin the backend's watcher: it calls `report` for each server that ends."""

    @abstractmethod
    def _stop(self, grace_s: float) -> None:
        """Stop every server (SIGTERM, SIGKILL after `grace_s`) and free what holds them."""

    # -- events ----------------------------------------------------------------------------------------------
    def watch(self) -> None:
        """Watch the servers while the job runs; started side by side, the watcher begins once they all answer
        (until then a server that fails is the start's failure, `not_started`)."""
        if not self._watching.is_set() and not self.stopping:
            self._watching.set()
            self._begin_watcher()

    def started_all(self) -> None:
        """Every server answered (`start` returned): the watcher begins if the job already watches."""
        self._ready.set()
        self._begin_watcher()

    def _begin_watcher(self) -> None:
        with self._begin_lock:
            if self._begun or not (self._ready.is_set() and self._watching.is_set()) or self.stopping:
                return
            self._begun = True
        self._watch()

    def not_started(self, error: Exception) -> None:
        """Side by side: the servers did not all start (`error`, a LaunchError naming the server): the job ends
        with it, as when they start first (an event `next_death` gives, never restarted). Once: the first
        error is the one named."""
        if self.stopping or self.start_error is not None:
            return
        self.start_error = error
        line = str(error).splitlines()[0] if str(error) else type(error).__name__
        self.fatal(ServerDeath(None, "the servers", str(error), line))

    def unwatch(self) -> None:
        with self._begin_lock:
            self._watching.clear()
            self._begun = False   # a later `watch` (the next attempt) begins a watcher again

    @property
    def watching(self) -> bool:
        return self._watching.is_set() and not self.stopping

    def report(self, death: ServerDeath) -> None:
        """A server died: its supervisor restarts it when the job survives that, else it is `fatal`. Ignored once
        `stop` began. Called by the set's watchers (any thread)."""
        if self.stopping:
            return
        if self.supervisor is None:
            self.fatal(death)
        else:
            self.supervisor.report(death)

    def fatal(self, death: ServerDeath) -> None:
        """Record a death the job does not survive (the first is kept as `failure`) and queue it for
        `next_death`; ignored once `stop` began."""
        if self.stopping:
            return
        if self.failure is None:
            self.failure = death
        self._deaths.put(death)

    def next_death(self, timeout: float = 0.0) -> ServerDeath | None:
        try:
            return self._deaths.get(timeout=timeout) if timeout > 0 else self._deaths.get_nowait()
        except queue.Empty:
            return None

    # -- the fleet (launchers/job_control.py's `Fleet`) ----------------------------------------------------------
    def fleets(self) -> dict[str, dict[str, int]]:
        """Each resizable role's replicas running now and its bounds (`min_replicas`, `max_replicas`)."""
        return self.supervisor.fleets() if self.supervisor is not None else {}

    @property
    def fleet_history(self) -> list[str]:
        """Each change of a fleet so far (a replica joined, left), for the job's summary."""
        return list(self.supervisor.history) if self.supervisor is not None else []

    def scale(self, role: str, replicas: int) -> str:
        """Resize `role` to `replicas` (fleet_resize.py's `scale`): the line of what was done; ScaleRefused."""
        from dualrun.contract.errors import ScaleRefused

        if self.supervisor is None:
            raise ScaleRefused("this job's servers cannot be resized")
        return self.supervisor.scale(role, replicas)

    # -- stop ------------------------------------------------------------------------------------------------
    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def wait_stopped(self, timeout: float | None = None) -> bool:
        """Block until `stop` begins (a thread that must outlive the servers it spawned waits here)."""
        return self._stopping.wait(timeout)

    def stop(self, grace_s: float = 10.0) -> None:
        self._watching.clear()
        self._stopping.set()
        self._stop(grace_s)

    def __enter__(self) -> "ServerSetBase":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
