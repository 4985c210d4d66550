"""A running job's control channel: what `dualrun scale ROLE N` reaches, on the machine that launched the job.

Why a channel of its own: the fleet lives in the launching process (its server set resizes a role), and the one
asking is another process, later, in another shell. The launcher serves HTTP on 127.0.0.1 at a free port while a
role of the job is resizable, and writes where and under which secret into this user's registry
(job_registry.py: a 0600 file in a 0700 directory): only a process that can read that file, the same user (or
root), can reach the fleet. Every request must carry the job's secret (`X-Dualrun-Job-Token`, compared in constant
time): 401 without it, 403 with a wrong one. `GET /fleets` -> {"run_id", "fleets"}; `POST /scale {"role",
"replicas"}` -> 200 {"line"}, 409 {"error"} (a `ScaleRefused`) or 410 {"error"} (the job ended during the resize).
Standard library only at import.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Mapping, Protocol, runtime_checkable

from dualrun.contract.errors import ScaleCutShort, ScaleRefused, one_line
from dualrun.contract.job_token import HEADER, refusal
from dualrun.launchers import job_registry
from dualrun.launchers.job_registry import JobRecord, RegistryRefused

MAX_BODY = 4096   # a resize request is a role name and a number


@runtime_checkable
class Fleet(Protocol):
    """What the job's server set offers the channel (servers/serverset.py's `ServerSetBase`)."""

    def fleets(self) -> dict[str, dict[str, int]]:
        """role name -> {"replicas": serving now (or starting), "min": min_replicas, "max": max_replicas}"""

    def scale(self, role: str, replicas: int) -> str:
        """Resize `role` to `replicas`; the one line of what was done (it may take a replica's start); raises
        ScaleRefused("one line why") when it cannot (unknown role, out of bounds, the job ending), ScaleCutShort
        when the job ended while a replica was joining."""


def resizable(fleets: Mapping[str, Mapping[str, int]]) -> dict[str, dict[str, int]]:
    """Pure: the roles whose bounds leave room to resize (max above min)."""
    return {role: dict(f) for role, f in fleets.items() if f.get("max", 0) > f.get("min", 0)}


def fleets_words(fleets: Mapping[str, Mapping[str, int]]) -> str:
    """Pure: `rollout: 1 now, 1-3; teacher: 2 now, 1-2`."""
    return "; ".join(f"{role}: {f.get('replicas', '?')} now, {f.get('min', '?')}-{f.get('max', '?')}"
                     for role, f in sorted(fleets.items()))


class JobControl:
    """The channel of one job's server set (one per set: a restart with fresh servers gets a fresh channel)."""

    def __init__(self, run_id: str, token: str, fleet: Fleet, config: str = "",
                 environ: Mapping[str, str] | None = None) -> None:
        if not token:
            raise ValueError("a job control channel needs the job's secret")
        self.run_id, self.token, self.fleet, self.config = run_id, token, fleet, config
        self.environ = environ
        self.path: Path | None = None
        self._server: ThreadingHTTPServer | None = None
        self._lock = threading.Lock()

    @property
    def address(self) -> str | None:
        if self._server is None:
            return None
        host, port = self._server.server_address[:2]
        return f"{host}:{port}"

    def start(self) -> str:
        """Serve and register; the line that says so. RegistryRefused (nothing left running) when the registry is
        not this user's alone."""
        server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="dualrun-job-control",
                         daemon=True).start()
        self._server = server
        roles = resizable(self.fleet.fleets())
        record = JobRecord(self.run_id, os.getpid(), self.address or "", self.token, time.time(), self.config, roles)
        try:
            self.path = job_registry.register(record, self.environ)
        except (RegistryRefused, OSError):
            self.stop()
            raise
        return (f"dualrun: job {self.run_id}: resize a fleet with `dualrun scale ROLE N` ({fleets_words(roles)})")

    def stop(self) -> None:
        """Unregister and stop serving (idempotent); a resize under way goes on in its own thread."""
        with self._lock:
            path, server, self.path, self._server = self.path, self._server, None, None
        if path is not None:
            job_registry.unregister(path)
        if server is not None:
            server.shutdown()
            server.server_close()

    def answer(self, method: str, path: str, header: str | None, body: bytes) -> tuple[int, dict[str, Any]]:
        """One request's status and JSON answer (the handler's logic, apart from the socket)."""
        denied = refusal(header, self.token)
        if denied is not None:
            return denied, {"error": "this job answers only requests carrying its secret"}
        if method == "GET" and path == "/fleets":
            return 200, {"run_id": self.run_id, "fleets": self.fleet.fleets()}
        if method == "POST" and path == "/scale":
            try:
                ask = json.loads(body or b"{}")
                role, replicas = ask["role"], ask["replicas"]
            except (ValueError, KeyError, TypeError):
                return 400, {"error": 'expected a JSON body {"role": NAME, "replicas": N}'}
            if not isinstance(role, str) or type(replicas) is not int or replicas < 0:
                return 400, {"error": "expected a role name and a number of replicas >= 0"}
            try:
                return 200, {"line": self.fleet.scale(role, replicas)}
            except ScaleRefused as e:
                return 409, {"error": one_line(str(e))}
            except ScaleCutShort as e:   # the job ended meanwhile: not the asker's fault, and not done
                return 410, {"error": one_line(str(e))}
            except Exception as e:  # noqa: BLE001 - the asker gets one line; the job goes on
                return 500, {"error": one_line(f"the resize failed: {type(e).__name__}: {e}")}
        return 404, {"error": "GET /fleets or POST /scale"}


def _handler(control: JobControl) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self._answer(b"")

        def do_POST(self) -> None:
            try:
                size = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                size = -1
            if not 0 <= size <= MAX_BODY:
                self._send(413, {"error": f"a body of at most {MAX_BODY} bytes"})
                return
            self._answer(self.rfile.read(size))

        def _answer(self, body: bytes) -> None:
            self._send(*control.answer(self.command, self.path, self.headers.get(HEADER), body))

        def _send(self, status: int, data: dict[str, Any]) -> None:
            payload = json.dumps(data).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(payload)
            self.close_connection = True

        def log_message(self, format: str, *args: Any) -> None:   # the launch's stderr is the job's
            pass

    return Handler


def control_for(run_id: str, token: str, servers: object, config: str = "") -> JobControl | None:
    """The launcher's one seam: a started channel for `servers` when they are a `Fleet` with a resizable role, else
    None. Its line is printed; a registry refused is printed too and the job goes on without the channel."""
    if not token or not isinstance(servers, Fleet) or not resizable(servers.fleets()):
        return None
    control = JobControl(run_id, token, servers, config)
    try:
        line = control.start()
    except (RegistryRefused, OSError) as e:
        print(f"dualrun: job {run_id}: no `dualrun scale` for this job: {one_line(str(e))}", file=sys.stderr,
              flush=True)
        return None
    print(line, file=sys.stderr, flush=True)
    return control
