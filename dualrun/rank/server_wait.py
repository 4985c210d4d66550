"""A rank started beside its job's servers waits for a server where it first connects to it.

Why: the launcher starts the trainers while the servers come up (`Launcher.start_servers`, side by side), so the
first step waits for the slower of the two, not their sum. TRL's clients poll a server's health before using it,
but a script of the user's may connect once and fail on the refused connection of a server still loading. Every
blocking HTTP client of the standard library and of `requests` opens its connection through
`socket.create_connection` or urllib3's copy of it: wrapped here, a connection to one of the servers still starting
(`DUALRUN_SERVERS_STARTING`, the addresses the launcher handed out) waits while the server refuses, up to the
seconds given there (the launcher ends the job, naming the server, when one does not answer within its
`health_timeout_s`: the ranks never wait past it in practice). Once a server accepted a connection, a refusal is an
error as always (a dead server is its set's event). Cost: one set lookup per connection.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from typing import Any, Callable, Mapping

from dualrun.contract.protocol import SERVERS_STARTING

# between two tries of a server that refuses: a refused connect costs microseconds, and what the rank waits past
# the server's first accepted connection is half of it on average (0.5 s cost 0.35 s on the GRPO start-up path)
RETRY_S = 0.1


class Starting:
    """The servers still starting (`host:port` -> role) and the deadline of the wait for them."""

    def __init__(self, servers: Mapping[str, str], wait_s: float, clock: Callable[[], float] = time.monotonic,
                 health: Mapping[str, str] | None = None) -> None:
        self.servers, self.clock, self.wait_s = dict(servers), clock, wait_s
        self.health = dict(health or {})   # address -> health path (rank/server_cores.py's check)
        self.deadline = clock() + wait_s
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "Starting | None":
        raw = environ.get(SERVERS_STARTING)
        if not raw:
            return None
        spec = json.loads(raw)
        return cls(spec["servers"], float(spec["wait_s"]), health=spec.get("health"))

    @staticmethod
    def _key(address: Any) -> str | None:
        """`host:port` of a `(host, port)` pair as `create_connection` gets it (None: not such a pair)."""
        try:
            return f"{address[0]}:{int(address[1])}"
        except (TypeError, ValueError, IndexError):
            return None

    def role(self, address: Any) -> str | None:
        """The role of the server at `address` while it is still starting."""
        with self._lock:
            return self.servers.get(self._key(address) or "")

    def reached(self, address: Any) -> None:
        with self._lock:
            self.servers.pop(self._key(address) or "", None)

    def wait(self, address: Any, connect: Callable[..., socket.socket], say: Callable[[str], None]) -> None:
        """Until the server at `address` accepts a connection (closed at once), or the deadline."""
        role = self.role(address)
        if role is None:
            return
        said = False
        while self.clock() < self.deadline:
            try:
                connect(address, timeout=5.0).close()
                break
            except ConnectionRefusedError:
                if not said:
                    say(f"waiting for the {role} server at {address[0]}:{address[1]}, which starts beside the "
                        "trainers")
                    said = True
                time.sleep(RETRY_S)
            except OSError:
                break   # not a server still starting: the client's own connection says what it is
        self.reached(address)


def _say(message: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"dualrun: {message}", file=sys.stderr, flush=True)


def wrap(create_connection: Callable[..., socket.socket], starting: Starting) -> Callable[..., socket.socket]:
    """`create_connection` that first waits for a server still starting (`starting`)."""
    if getattr(create_connection, "_dualrun_waits", False):
        return create_connection

    def waiting_create_connection(address: Any, *args: Any, **kwargs: Any) -> socket.socket:
        if starting.servers:
            starting.wait(address, create_connection, _say)
        return create_connection(address, *args, **kwargs)

    waiting_create_connection._dualrun_waits = True  # type: ignore[attr-defined]
    return waiting_create_connection


def activate(environ: Mapping[str, str] | None = None) -> None:
    """In a rank started beside its servers: wrap the standard library's and urllib3's `create_connection`."""
    starting = Starting.from_env(os.environ if environ is None else environ)
    if starting is None:
        return
    from dualrun.rank.hooks import when_imported

    socket.create_connection = wrap(socket.create_connection, starting)  # type: ignore[assignment]

    def patch_urllib3(module: Any) -> None:
        module.create_connection = wrap(module.create_connection, starting)

    when_imported("urllib3.util.connection", patch_urllib3)
