"""The router's HTTP/1.1 calls to its replicas (dualrun/programs/upstream.py) against real sockets: answers framed
every way an engine may frame them, connections kept and reused, and each way a call can fail ending as the router
expects (OSError: unreachable or broken off; asyncio.TimeoutError: hung), never leaving a connection whose answer
is still due in the pool."""
from __future__ import annotations

import asyncio

import pytest

from dualrun.programs.upstream import Upstream, UpstreamError


async def _server(answers: list, seen: list | None = None, pause: float = 0.0):
    """A raw HTTP server on a free loopback port: reads each request whole (headers and Content-Length body) and
    writes the next answer of `answers` (a list of byte pieces, `pause` s apart, a None piece closing the
    connection; None for the whole answer: closed without one). `seen` gets (connection number, request bytes)."""
    connections = [0]

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections[0] += 1
        number = connections[0]
        try:
            while answers:
                head = await reader.readuntil(b"\r\n\r\n")
                length = [int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")]
                body = await reader.readexactly(length[0]) if length else b""
                if seen is not None:
                    seen.append((number, head + body))
                pieces = answers.pop(0)
                if pieces is None or None in pieces:
                    for piece in (pieces or [])[:-1]:
                        writer.write(piece)
                    break
                for piece in pieces:
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(pause)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(client, "127.0.0.1", 0)
    return server, f"127.0.0.1:{server.sockets[0].getsockname()[1]}"


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json; charset=utf-8\r\nContent-Length: 7\r\n\r\n{\"a\":1}"


def test_answers_framed_by_length_chunks_or_the_close_and_the_connection_kept_only_where_it_can_be():
    async def main():
        seen: list = []
        answers = [
            [OK[:20], OK[20:50], OK[50:]],                                     # a Content-Length, in pieces
            [b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc",
             b"\r\n2;x=y\r\nde\r\n0\r\nTrailer: t\r\n\r\n"],                  # 1xx skipped; chunks and a trailer
            [b"HTTP/1.1 204 No Content\r\n\r\n"],                            # no body
            [b"HTTP/1.0 500 Oops\r\nContent-Type: text/plain\r\n\r\nto the end", None],   # read to the close
            [OK],                                                              # (a new connection)
        ]
        server, address = await _server(answers, seen, pause=0.01)
        up = Upstream({"X-Job": "s"})
        try:
            assert await up.request(address, "POST", "/v1/completions", b"{}", "application/json") == \
                (200, b'{"a":1}', "application/json")
            assert await up.request(address, "GET", "/x?q=1") == (201, b"abcde", "application/octet-stream")
            assert await up.request(address, "POST", "/y") == (204, b"", "application/octet-stream")
            assert await up.request(address, "GET", "/z") == (500, b"to the end", "text/plain")
            assert (await up.request(address, "GET", "/health"))[0] == 200
        finally:
            up.close()
            server.close()
        assert [n for n, _ in seen] == [1, 1, 1, 1, 2]   # kept alive until the close-framed answer
        first = seen[0][1]
        assert first.startswith(b"POST /v1/completions HTTP/1.1\r\n") and first.endswith(b"\r\n\r\n{}")
        for line in (f"Host: {address}".encode(), b"X-Job: s", b"Content-Type: application/json",
                     b"Content-Length: 2"):
            assert line in first.split(b"\r\n")
        assert b"Content-Length" not in seen[1][1] and seen[1][1].startswith(b"GET /x?q=1 HTTP/1.1\r\n")
        assert b"Content-Length: 0" in seen[2][1]   # a POST without a body says so

    _run(main())


def test_a_connection_the_replica_closed_while_idle_is_not_reused_and_a_break_before_the_answer_is_retried_once():
    async def main():
        seen: list = []
        server, address = await _server([[OK], None, [OK]], seen)
        up = Upstream()
        try:
            assert (await up.request(address, "POST", "/a", b"1"))[0] == 200
            # the replica reads the next request on the kept connection and closes it unanswered: a new one
            assert (await up.request(address, "POST", "/b", b"2"))[0] == 200
        finally:
            up.close()
            server.close()
        assert [n for n, _ in seen] == [1, 1, 2]

    _run(main())


def test_a_break_mid_answer_a_bad_answer_and_a_refused_connection_are_oserrors():
    async def main():
        server, address = await _server([[OK[:-3], None]])   # (a new connection: nothing to retry)
        bad, bad_address = await _server([[b"SSH-2.0-OpenSSH\r\n\r\n"]])
        up = Upstream()
        try:
            with pytest.raises(UpstreamError):
                await up.request(address, "POST", "/a", b"1")
            with pytest.raises(UpstreamError, match="not an HTTP"):
                await up.request(bad_address, "GET", "/")
            port = server.sockets[0].getsockname()[1]
            server.close()
            await server.wait_closed()
            with pytest.raises(OSError):
                await up.request(f"127.0.0.1:{port}", "GET", "/")
            assert up._idle.get(address, []) == [] and up._idle.get(bad_address, []) == []
        finally:
            up.close()
            bad.close()

    _run(main())


def test_a_timeout_and_a_cancel_close_the_connection_whose_answer_is_still_due():
    async def main():
        seen: list = []
        server, address = await _server([[b"HTTP/1.1 200 OK\r\n", OK], [OK[:10], OK[10:]], [OK]], seen, pause=1.0)
        up = Upstream()
        try:
            with pytest.raises(asyncio.TimeoutError):
                await up.request(address, "GET", "/slow", timeout=0.2)
            call = asyncio.ensure_future(up.request(address, "GET", "/cancelled"))
            await asyncio.sleep(0.2)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            assert up._idle.get(address, []) == []
            assert await up.request(address, "GET", "/next", timeout=10) == (200, b'{"a":1}', "application/json")
        finally:
            up.close()
            server.close()
        assert [n for n, _ in seen] == [1, 2, 3]   # a fresh connection after each

    _run(main())


def test_a_header_value_with_a_line_break_is_refused():
    with pytest.raises(ValueError):
        Upstream({"Authorization": "Bearer k\r\nX-Evil: 1"})

    async def main():
        with pytest.raises(ValueError):
            await Upstream().request("127.0.0.1:1", "POST", "/a", b"", "text/plain\r\nX-Evil: 1")

    _run(main())
