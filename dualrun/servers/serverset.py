"""The interface of a job's server set, on either backend: start, addresses, wiring, events of a dying server, stop.

Why one interface: both launchers run the plan's servers the same way (start them before the trainers, hand the
trainers their wiring, end or restart the job when one dies, stop them with the job) whether they run as
processes here (`LocalServers`, local.py; several machines: `Machines`, machines.py, around it) or from Ray actors
(`RayServers`, ray_server.py). A dying server is an event (`ServerDeath`, naming which of `plan.servers` it was)
that the launcher takes from `next_death`; the set's own watcher (a thread polling its processes, or one waiting
on its actors) reports it, and the set's supervisor (supervisor.py) restarts a replica the job survives losing;
only the deaths it does not survive reach `next_death`.
"""
from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Protocol

from dualrun.servers.server_death import ServerDeath

if TYPE_CHECKING:
    from dualrun.servers.supervisor import Supervisor

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

    @abstractmethod
    def start(self) -> dict[str, str]:
        """ServerSet.start."""

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
        if not self._watching.is_set() and not self.stopping:
            self._watching.set()
            self._watch()

    def unwatch(self) -> None:
        self._watching.clear()

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
