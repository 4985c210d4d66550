"""`servers.process.probe`: one health probe, with the connection and the answer bounded apart.

Why apart: a live machine's kernel accepts a connection within milliseconds however busy its server is, so the
other machines' health checks (servers/machines.py) find a dead server or a lost machine within a short connection
bound, while a server busy on a loaded machine keeps the router's whole answer bound. Real sockets on loopback."""
from __future__ import annotations

import socket
import time

from dualrun.servers.process import http_ok, probe
from helpers import health_server


def _url(server, path: str = "/health") -> str:
    return f"http://127.0.0.1:{server.server_address[1]}{path}"


def test_a_slow_answer_passes_within_the_answer_bound_whatever_the_connection_bound():
    server = health_server(delay_s=0.6)
    try:
        assert probe(_url(server), 5.0, connect_s=0.2) == (True, "health probe answered 200")
        assert probe(_url(server), 0.2) == (False, "health probe not answered within 0.2 s")
        assert probe(_url(server), 0.2, connect_s=5.0) == (False, "health probe not answered within 0.2 s")
    finally:
        server.shutdown()
        server.server_close()


def test_an_error_status_and_a_wrong_path_are_failures_named_by_their_code():
    server = health_server(status={"/health": 503}, default=404)
    try:
        assert probe(_url(server), 2.0, connect_s=1.0) == (False, "health probe answered 503")
        assert probe(_url(server, "/nope?x=1"), 2.0) == (False, "health probe answered 404")
        assert not http_ok(_url(server))
    finally:
        server.shutdown()
        server.server_close()


def test_a_connection_not_accepted_fails_within_the_connection_bound():
    """A listener whose accept queue is full drops new connections (SYNs unanswered), as a lost machine does."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    queued = [socket.create_connection(("127.0.0.1", port), timeout=2.0)]   # fills the queue (backlog 0: one)
    try:
        started = time.monotonic()
        assert probe(f"http://127.0.0.1:{port}/health", 30.0, connect_s=0.3) == (
            False, "health probe: no connection within 0.3 s")
        assert time.monotonic() - started < 10.0   # the 30-s answer bound never started
    finally:
        for sock in queued:
            sock.close()
        listener.close()


def test_nothing_listening_is_refused_at_once():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]   # bound, not listening: refused
        ok, detail = probe(f"http://127.0.0.1:{port}/health", 5.0, connect_s=1.0)
    assert not ok and detail.startswith("health probe: ConnectionRefusedError: "), detail
    assert probe("http://127.0.0.1:notaport/health", 1.0)[1].startswith("health probe: ValueError: ")
