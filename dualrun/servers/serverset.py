"""The interface of a job's server set, on either backend: start, addresses, events of a dying server, stop.

Why one interface: both launchers run the plan's servers the same way (start them before the trainers, hand the
trainers their addresses, end or restart the job when one dies, stop them with the job) whether they run as
processes here (`LocalServers`, local.py) or from Ray actors (`RayServers`, ray_server.py). A dying server is an
event (`ServerDeath`, naming which of `plan.servers` it was) that the launcher takes from `next_death`; the set's
own watcher (a thread polling its processes, or one waiting on its actors) puts it there. An event names one
server of the plan by index, so the set can replace that one server (same devices, fresh port: `_replace`) when
`replacing.survivable` says the job survives it; only the deaths it does not survive reach `next_death`. The
restart's steps (router `replace`, the wait for rotation, the event lines) and the search for hung replicas are
here, once for both backends; each backend only starts one replica again (`_respawn`) and stops a hung one.
"""
from __future__ import annotations

import queue
import sys
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from dualrun.servers.process import ServerError

START_TRIES = 3   # a server whose free port was taken between picking and binding it is started again, this often
HUNG_EVERY_S = 1.0   # how often a set's watcher asks the routers for hung replicas (they probe about once a second)



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

    cfg: Any   # the job's config (each backend sets it)

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
        self.started: dict[int, str] = {}   # plan.servers index -> address of its serving process (LocalServers
                                            # on machine 0: every machine's)
        self._probe_out: dict[int, float] = {}   # replica -> when the set first saw it out of rotation

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

    def report(self, death: ServerDeath) -> None:
        """A server died: a replica with restarts left while another serves is restarted (`_replace`, in a
        thread of its own), the job going on; any other death is `fatal`. Ignored once `stop` began. Called by
        the set's watchers (any thread)."""
        from dualrun.servers.replacing import restarting_line, survivable

        if self.stopping:
            return
        serving = death.index in self.restarts_left and self.watching and self._others_serving(death.index)
        with self._policy:
            replace = serving and survivable(self.plan, death.index, self.restarts_left, self._down)
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

    # -- restarting a replica (replacing.py's rules; the backend's hooks below) -----------------------------------
    def enable_restarts(self, cfg: Any) -> None:
        """Restart the replicas `replacing.restart_budget` allows (a backend that implements the hooks)."""
        from dualrun.servers.replacing import restart_budget

        self.restarts_allowed = restart_budget(cfg, self.plan)
        self.restarts_left = dict(self.restarts_allowed)

    def _others_serving(self, index: int) -> bool:
        """Backend: whether another replica of `index`'s role may still serve, beyond this set's own view
        (`_down`): several torchrun machines ask the router (another machine's replica may be down)."""
        return True

    def _respawn(self, index: int) -> tuple[str, float] | None:
        """Backend: the dead replica `index` started again on its devices on a fresh port and healthy; (its
        address, its health timeout), None when the set is being stopped. ServerError when it fails."""
        raise NotImplementedError

    def _serving(self, index: int, address: str) -> bool:
        """Backend: the restarted replica is in rotation at `address`; its next end is an event again. False when
        the set is being stopped."""
        raise NotImplementedError

    def _alive(self, index: int) -> bool:
        """Backend: whether replica `index`'s process runs (a hung one does; a dead one is the watcher's)."""
        raise NotImplementedError

    def _stop_hung(self, index: int) -> tuple[str, str | None]:
        """Backend: stop the hung replica `index` (SIGTERM, SIGKILL after HUNG_GRACE_S) without its end being an
        event of its own; its log's last lines and its log's path."""
        raise NotImplementedError

    def _replace(self, death: ServerDeath) -> None:
        """Restart the dead replica `death.index` (`_respawn`), have its router replace its address and wait until
        it is back in rotation (a thread of its own). Any failure on the way ends the job (`fatal`), naming it."""
        index = death.index
        assert index is not None
        died = time.monotonic()
        label = self.plan.servers[index].label
        try:
            self._restart(index, label, died)
        except ServerError as e:
            self.fatal(ServerDeath.of(index, e))
        except (OSError, RuntimeError) as e:
            self.fatal(ServerDeath.of(index, ServerError(label, f"could not be taken back by its router after a "
                                                                f"restart ({e})")))
        self.wait_stopped()   # a local engine's parent-death signal fires when the thread that spawned it ends

    def _restart(self, index: int, label: str, died: float) -> None:
        """`_replace`'s steps: `remove` at the router (out of the weight-sync group: the next sync goes on without
        it), respawn, `replace` at the router (held until its first weight update when it takes the trainer's
        weights: `replacing.takes_weights`), wait for rotation, the line that it is back."""
        from dualrun.servers import router_client
        from dualrun.servers.replacing import back_line, held_line, router_of, takes_weights

        router, slot = router_of(self.plan, index)
        router_client.control(self.started[router], slot, "remove", reason="died; being restarted")
        fresh = self._respawn(index)
        if fresh is None:
            return
        address, timeout_s = fresh
        hold = takes_weights(self.cfg, self.plan.servers[index])
        router_client.control(self.started[router], slot, "replace", address=address, hold=hold)
        if hold:
            print(held_line(label, address), file=sys.stderr, flush=True)
        deadline = None if hold else time.monotonic() + timeout_s   # held: until the next sync, however far
        while self.watching and slot not in router_client.replicas(self.started[router])["in_rotation"]:
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError(f"its router's health probes did not pass within {timeout_s:g} s")
            if not self._alive(index):
                raise ServerError(label, "exited before its router took it back (its log says why)")
            time.sleep(0.1)   # the router's probes pass about once a second
        if not self._serving(index, address):
            return
        self.replaced(index)
        if self.watching:   # else the job's ranks ended meanwhile: its router takes it back on its own
            print(back_line(label, address, time.monotonic() - died), file=sys.stderr, flush=True)

    def find_hung(self, now: float) -> None:
        """Ask each router with restartable replicas for its table: a replica it found hung (`replacing.hung`) is
        stopped and its death reported as being hung, so it is restarted; without a restart left (or no other
        replica serving) it stays out of rotation, routed around. The set's watcher calls it about once a second."""
        from dualrun.servers import router_client
        from dualrun.servers.planned import server_role
        from dualrun.servers.replacing import hung, hung_line, router_of, survivable

        for index in list(self.restarts_left):
            router, slot = router_of(self.plan, index)
            if router not in self.started or index in self._down or not self._alive(index):
                self._probe_out.pop(index, None)
                continue
            try:
                row = router_client.replicas(self.started[router], timeout_s=2.0)["replicas"][slot]
            except (OSError, ValueError, KeyError, IndexError):
                continue   # the router's own death is the watcher's event
            out_for = now - self._probe_out.setdefault(index, now) if not row.get("in_rotation") else 0.0
            if row.get("in_rotation"):
                self._probe_out.pop(index, None)
            if not hung(row, out_for, server_role(self.cfg, self.plan.servers[index]).request_timeout_s):
                continue
            with self._policy:
                if not survivable(self.plan, index, self.restarts_left, self._down):
                    continue
            label = self.plan.servers[index].label
            print(hung_line(label, row.get("reason") or "out of rotation"), file=sys.stderr, flush=True)
            tail, log_path = self._stop_hung(index)
            self._probe_out.pop(index, None)
            self.report(ServerDeath.of(index, ServerError(label, f"was hung ({row.get('reason')})", tail, log_path)))

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
