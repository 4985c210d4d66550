"""The interface of a job's server set, on either backend: start, addresses, events of a dying server, stop.

Why one interface: both launchers run the plan's servers the same way (start them before the trainers, hand the
trainers their addresses, end or restart the job when one dies, stop them with the job) whether they run as
processes here (`LocalServers`, local.py) or from Ray actors (`RayServers`, ray_server.py). A dying server is an
event (`ServerDeath`, naming which of `plan.servers` it was) that the launcher takes from `next_death`; the set's
own watcher (a thread polling its processes, or one waiting on its actors) puts it there. An event names one
server of the plan by index, so a backend can replace that one server (same devices, fresh port: `_replace`) when
`replacing.survivable` says the job survives it; only the deaths it does not survive reach `next_death`.
"""
from __future__ import annotations

import queue
import sys
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from dualrun.servers.process import ServerError

START_TRIES = 3   # a server whose free port was taken between picking and binding it is started again, this often



@dataclass(frozen=True)
class ServerDeath:
    """One server of the set ended (or stopped answering) while the job ran.

    `index`: its place in `plan.servers` (None: not one server, e.g. the machines' address exchange failed).
    `text`: the full error (its label, exit code or signal, its log's last lines); `str()` gives it."""

    index: int | None
    label: str
    text: str
    line: str

    @classmethod
    def of(cls, index: int | None, error: ServerError) -> "ServerDeath":
        return cls(index, error.label, str(error), error.one_line())

    def one_line(self) -> str:
        """Label, how it ended, and its log's last line: for the restart line."""
        return self.line

    def __str__(self) -> str:
        return self.text


class ServerSet(ABC):
    """The plan's servers of one job (a set is started once; a restart with fresh servers is a new set).

    `addresses`: role -> `host:port` once started (user-run servers, `address:`, from the start). `failure`: the
    first death reported, kept. The set's watcher runs only while it is watched (`watch` .. `unwatch`), and
    nothing is reported once `stop` began, so the servers' normal end is no event."""

    def __init__(self, plan: Any) -> None:
        self.plan = plan
        self.addresses: dict[str, str] = dict(plan.external)
        self.failure: ServerDeath | None = None
        self._deaths: "queue.Queue[ServerDeath]" = queue.Queue()
        self._watching = threading.Event()
        self._stopping = threading.Event()   # the set's one stop flag: set when `stop` begins
        self.restarts_left: dict[int, int] = {}   # plan.servers index -> restarts left (replacing.py; set by a
        self.restarts_allowed: dict[int, int] = {}   # backend that implements `_replace`)
        self._down: set[int] = set()        # replicas being restarted
        self._policy = threading.Lock()

    @abstractmethod
    def start(self) -> dict[str, str]:
        """Start every server (all of a phase at once), wait until each is healthy; role -> address. On failure
        every server started so far is stopped and a LaunchError names the server and quotes its log."""

    @abstractmethod
    def wiring_env(self) -> dict[str, str]:
        """Env for the trainer ranks: the plugin's wiring of the servers' addresses."""

    @abstractmethod
    def used(self) -> frozenset[str]:
        """`host:port` of every endpoint this set bound: the next set (a restart) never reuses one."""

    @abstractmethod
    def _watch(self) -> None:
        """Begin the backend's watcher: it calls `report` for each server that ends."""

    @abstractmethod
    def _stop(self, grace_s: float) -> None:
        """Stop every server (SIGTERM, SIGKILL after `grace_s`) and free what holds them."""

    # -- events ----------------------------------------------------------------------------------------------
    def watch(self) -> None:
        """While the job runs: report each server that ends as a `ServerDeath` (`next_death`)."""
        if not self._watching.is_set() and not self.stopping:
            self._watching.set()
            self._watch()

    def unwatch(self) -> None:
        """The job's ranks are done: the servers may end now without it being an event."""
        self._watching.clear()

    @property
    def watching(self) -> bool:
        return self._watching.is_set() and not self.stopping

    def _replace(self, death: ServerDeath) -> None:
        """Restart the dead replica `death.index` on its devices and have its router take it back (a thread of
        its own); `fatal` when that fails. Only backends that set `restarts_left` implement it."""
        raise NotImplementedError

    def report(self, death: ServerDeath) -> None:
        """A server died: a replica with restarts left while another serves is restarted (`_replace`, in a
        thread of its own), the job going on; any other death is `fatal`. Ignored once `stop` began. Called by
        the set's watchers (any thread)."""
        from dualrun.servers.replacing import restarting_line, survivable

        if self.stopping:
            return
        with self._policy:
            replace = self.watching and survivable(self.plan, death.index, self.restarts_left, self._down)
            if replace:
                assert death.index is not None
                self.restarts_left[death.index] -= 1
                self._down.add(death.index)
                allowed = self.restarts_allowed[death.index]
                line = restarting_line(death.one_line(), allowed - self.restarts_left[death.index], allowed)
        if not replace:
            self.fatal(death)
            return
        print(line, file=sys.stderr, flush=True)
        threading.Thread(target=self._replace, args=(death,), name="dualrun-replace", daemon=True).start()

    def replaced(self, index: int) -> None:
        """The replica `index` serves again (its next death is an event like the first)."""
        with self._policy:
            self._down.discard(index)

    def fatal(self, death: ServerDeath) -> None:
        """Record a death the job does not survive (the first is kept as `failure`) and queue it for
        `next_death`; ignored once `stop` began."""
        if self.stopping:
            return
        if self.failure is None:
            self.failure = death
        self._deaths.put(death)

    def next_death(self, timeout: float = 0.0) -> ServerDeath | None:
        """The next death reported, waiting up to `timeout` s for one; None if none came."""
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
        """Stop every server (idempotent); on success, failure and interruption alike."""
        self._watching.clear()
        self._stopping.set()
        self._stop(grace_s)

    def __enter__(self) -> "ServerSet":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
