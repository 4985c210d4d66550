"""One server process on this node: start it, wait until its health endpoint answers, stop it.

Why a process group: engines such as vLLM start helper processes of their own; stopping the group leaves
nothing behind. Why a tee thread: the user sees the server's output live (prefixed with its label) and an
error can quote the log's last lines without reading the file back.
"""
from __future__ import annotations

import collections
import signal
import subprocess
import sys
import threading
import time
from typing import Mapping, Sequence, TextIO

from dualrun.contract.redact import hide_values, secret_values
from dualrun.light.child_process import ChildProcess
from dualrun.light.interpreter import resolve
from dualrun.light.parent_death import terminate_with_parent
from dualrun.servers.cpu_share import bind_share, unbound_note

TAIL_LINES = 30
# the longest wait between two health checks of a starting server: the trainers start beside it and wait for it
# (rank/server_wait.py, every 0.1 s as well); the launcher, which watches it once healthy, should know about as soon
HEALTH_POLL_S = 0.1


_PORT_IN_USE = ("address already in use", "errno 98")


class ServerError(RuntimeError):
    """A server failed to start or to become healthy; the message ends with the tail of its log."""

    def __init__(self, label: str, reason: str, tail: str = "", log_path: str | None = None) -> None:
        self.label, self.reason, self.tail, self.log_path = label, reason, tail, log_path
        text = f"{label} {reason}"
        if log_path:
            text += f" (log: {log_path})"
        if tail.strip():
            text += "\n--- last lines of its log ---\n" + tail.rstrip()
        super().__init__(text)

    @property
    def lost_port(self) -> bool:
        """Whether it failed because its free port was taken between picking and binding it (pick another)."""
        return any(s in self.tail.lower() for s in _PORT_IN_USE)

    def one_line(self) -> str:
        last = next((ln for ln in reversed(self.tail.strip().splitlines()) if ln.strip()), "")
        return f"{self.label} {self.reason}" + (f": {last.strip()}" if last else "")


def died(label: str, code: int | None, tail: str = "", log_path: str | None = None) -> ServerError:
    """The error for a server that ended while the job ran: its label (role and replica), its exit code (and the
    signal that killed it) and the last lines of its log. One wording for both backends."""
    how = f"exited with code {code}"
    if code is not None and code < 0:
        try:
            how += f" (killed by {signal.Signals(-code).name})"
        except ValueError:
            pass
    return ServerError(label, f"{how} while the job was running", tail, log_path)


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """True when `url` answers 200 (`probe`'s verdict alone)."""
    return probe(url, timeout)[0]


def probe(url: str, timeout: float, connect_s: float | None = None) -> tuple[bool, str]:
    """One health probe of `url`: whether it answered 200, and what it got, in the router's words.

    `connect_s` (default: `timeout`) bounds the connection alone and `timeout` the answer: a live machine's kernel
    accepts a connection within milliseconds however busy its server is, so a short connection bound finds a lost
    machine or a dead server fast while a busy server keeps the whole `timeout` to answer. Proxies are bypassed:
    servers are always addressed directly (`http.client`, no environment read)."""
    import http.client   # here: ~14 ms (http.client, ssl, email) a job without servers need not pay
    import socket
    from urllib.parse import urlsplit

    conn = None
    try:
        parts = urlsplit(url)
        conn = http.client.HTTPConnection(parts.hostname or "", parts.port,
                                          timeout=timeout if connect_s is None else connect_s)
        if connect_s is not None:   # else `request` connects, bounded by `timeout` as a whole
            try:
                conn.connect()
            except (TimeoutError, socket.timeout):
                return False, f"health probe: no connection within {connect_s:g} s"
            conn.sock.settimeout(timeout)
        conn.request("GET", (parts.path or "/") + (f"?{parts.query}" if parts.query else ""))
        status = conn.getresponse().status
        return status == 200, f"health probe answered {status}"
    except (TimeoutError, socket.timeout):
        return False, f"health probe not answered within {timeout:g} s"
    except (OSError, ValueError, http.client.HTTPException) as e:
        return False, f"health probe: {type(e).__name__}: {e}"
    finally:
        if conn is not None:
            conn.close()


class ServerProcess:
    """A server command bound to `host:port`, whose health is `GET http://host:port<health_path>` == 200."""

    def __init__(self, label: str, argv: Sequence[str], env: Mapping[str, str], host: str, port: int,
                 health_path: str = "/health", timeout_s: float = 600.0, log_path: str | None = None,
                 stream: TextIO | None = sys.stderr, check_host: str | None = None,
                 die_with_parent: bool = True, cwd: str | None = None) -> None:
        # a command built elsewhere names no interpreter path (light/interpreter.py): the spawning process runs its own
        self.label, self.argv, self.env = label, resolve(argv), bind_share(env)   # its own cores: cpu_share.py
        self.host, self.port, self.health_path, self.timeout_s = host, port, health_path, timeout_s
        self.log_path, self.stream, self.die_with_parent = log_path, stream, die_with_parent
        self.cwd = cwd   # where relative paths in the command (a role's `model: tiny/teacher`) resolve
        # a server bound to 0.0.0.0 is checked on loopback: the check runs on the server's own node
        self.check_host = check_host or ("127.0.0.1" if host in ("0.0.0.0", "") else host)
        self.child = ChildProcess()   # its own process group: stopped as one
        self._secrets = secret_values(self.argv)   # its secret flags' values: masked in every line it prints
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._reader: threading.Thread | None = None

    @property
    def proc(self) -> subprocess.Popen | None:
        return self.child.proc

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def health_url(self) -> str:
        return f"http://{self.check_host}:{self.port}{self.health_path}"

    def tail(self) -> str:
        return "\n".join(self._tail)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> "ServerProcess":
        log = open(self.log_path, "a", buffering=1) if self.log_path else None  # noqa: SIM115 - closed by reader
        try:
            proc = self.child.start(self.argv, self.env, self.cwd,
                                    terminate_with_parent if self.die_with_parent else None,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                                    bufsize=1)
        except OSError as e:
            if log:
                log.close()
            raise ServerError(self.label, f"could not start `{self.argv[0]}`: {e}") from None
        note = unbound_note(self.env)
        if note:
            self._write(note + "\n", log)   # dualrun's own line about this server, where its output goes
        self._reader = threading.Thread(target=self._pump, args=(proc.stdout, log),
                                        name=f"dualrun-{self.label}", daemon=True)
        self._reader.start()
        return self

    def _write(self, line: str, log) -> None:
        """One line (ending in a newline) to the log file as it is and to the stream `[label]`-prefixed."""
        if log:
            log.write(line)
        if self.stream is not None:
            try:
                self.stream.write(f"[{self.label}] {line}")
                self.stream.flush()
            except (ValueError, OSError):
                pass

    def _pump(self, pipe, log) -> None:
        try:
            for line in pipe:
                if self._secrets:
                    line = hide_values(line, self._secrets)
                self._tail.append(line.rstrip("\n"))
                self._write(line, log)
        finally:
            if log:
                log.close()

    def wait_healthy(self, deadline: float | None = None) -> None:
        """Block until healthy; ServerError (with the log's tail) on exit or when the timeout passes."""
        deadline = deadline if deadline is not None else time.monotonic() + self.timeout_s
        delay = 0.1
        while True:
            if self.proc is None:
                raise ServerError(self.label, "was never started")
            code = self.proc.poll()
            if code is not None:
                self._drain()
                raise ServerError(self.label, f"exited with code {code} before it became healthy",
                                  self.tail(), self.log_path)
            if http_ok(self.health_url, timeout=min(2.0, max(0.1, deadline - time.monotonic()))):
                return
            if time.monotonic() >= deadline:
                raise ServerError(self.label, f"did not become healthy within {self.timeout_s:g} s "
                                              f"({self.health_url})", self.tail(), self.log_path)
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 1.5, HEALTH_POLL_S)

    def wait_exit(self) -> ServerError:
        """Block until the server ends (by itself or by `stop`); the error that names it and quotes its log."""
        assert self.proc is not None, "start() was not called"
        code = self.proc.wait()
        self._drain()
        return died(self.label, code, self.tail(), self.log_path)

    def _drain(self) -> None:
        if self._reader is not None:
            self._reader.join(timeout=2.0)

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the whole process group, SIGKILL after `grace_s`. Idempotent; returns the exit code."""
        code = self.child.stop(grace_s)
        self._drain()
        return code
