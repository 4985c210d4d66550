"""A rank started beside its servers waits where it first connects to one (dualrun/rank/server_wait.py): real sockets
on loopback, a listener that comes up late, in milliseconds to a few seconds."""
from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request

import pytest

from dualrun.contract.protocol import SERVERS_STARTING
from dualrun.light.ports import free_port, server_port
from dualrun.rank import server_wait


def _listen_later(port: int, after_s: float) -> threading.Thread:
    """A minimal HTTP server on `port` that starts listening after `after_s` and answers one request 200."""

    def run() -> None:
        time.sleep(after_s)
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen(8)
            s.settimeout(20)
            while True:   # the waiter's own probe connects and closes first; the client's request follows
                conn, _ = s.accept()
                with conn:
                    if conn.recv(65536):
                        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
                        return

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _wrapped(port: int, wait_s: float, said: list[str]):
    starting = server_wait.Starting({f"127.0.0.1:{port}": "teacher"}, wait_s)
    original = socket.create_connection

    def create(address, *args, **kwargs):   # the wrapper, with its line caught
        if starting.servers:
            starting.wait(address, original, said.append)
        return original(address, *args, **kwargs)

    return starting, create


def test_a_first_connection_waits_while_the_server_refuses_then_goes_through():
    port, said = free_port(), []
    starting, create = _wrapped(port, 20.0, said)
    server = _listen_later(port, 1.0)
    t0 = time.monotonic()
    with create(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert conn.recv(100).startswith(b"HTTP/1.1 200")
    assert 0.9 < time.monotonic() - t0 < 15
    assert said == [f"waiting for the teacher server at 127.0.0.1:{port}, which starts beside the trainers"]
    assert not starting.servers   # reached: a later refusal is the client's error at once
    server.join(5)
    t0 = time.monotonic()
    with pytest.raises(ConnectionRefusedError):
        create(("127.0.0.1", port), timeout=5)
    assert time.monotonic() - t0 < 1


def test_the_wait_ends_at_its_deadline_and_the_client_sees_the_refusal():
    port, said = free_port(), []
    _, create = _wrapped(port, 1.0, said)
    t0 = time.monotonic()
    with pytest.raises(ConnectionRefusedError):
        create(("127.0.0.1", port), timeout=5)
    assert 0.9 < time.monotonic() - t0 < 5


def test_other_addresses_are_not_waited_for():
    port, other, said = free_port(), free_port(), []
    _, create = _wrapped(port, 20.0, said)
    t0 = time.monotonic()
    with pytest.raises(ConnectionRefusedError):
        create(("127.0.0.1", other), timeout=5)
    assert time.monotonic() - t0 < 1 and not said


def test_activate_wraps_urllib_and_requests_from_the_launchers_variable(monkeypatch):
    """What a rank's bootstrap does: the variable the server set hands the ranks, then urllib's and requests'
    connections wait."""
    import urllib3.util.connection as u3

    port = free_port()
    env = {SERVERS_STARTING: json.dumps({"servers": {f"127.0.0.1:{port}": "rollout"}, "wait_s": 20})}
    monkeypatch.setattr(socket, "create_connection", socket.create_connection)
    monkeypatch.setattr(u3, "create_connection", u3.create_connection)
    server_wait.activate(env)
    assert getattr(socket.create_connection, "_dualrun_waits", False)
    assert getattr(u3.create_connection, "_dualrun_waits", False)
    _listen_later(port, 1.0)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://127.0.0.1:{port}/health", timeout=10) as r:
        assert r.status == 200


def test_nothing_is_wrapped_without_the_variable(monkeypatch):
    monkeypatch.setattr(socket, "create_connection", socket.create_connection)
    before = socket.create_connection
    server_wait.activate({})
    assert socket.create_connection is before


def test_a_handed_out_port_is_below_the_range_outgoing_connections_take_theirs_from():
    from dualrun.light.ports import _ephemeral_range

    low, _ = _ephemeral_range()
    if low <= 21000:
        pytest.skip(f"this machine's ephemeral range starts at {low}")
    for _ in range(20):
        assert 20000 <= server_port() < low
