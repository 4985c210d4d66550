"""The router's calls to its replicas: HTTP/1.1 over kept-alive connections, and nothing a call does not need.

Why not aiohttp's `ClientSession`: a call through it builds a `ClientRequest` and a `ClientResponse` (URL parsing,
header multidicts, cookie, auth, proxy and compression steps, trace hooks, a payload object, a stream reader), about
150 µs of CPU per call on this machine, three quarters of the router's whole cost per forwarded request; at 64 in
flight on 2 cores that CPU is the router's added latency (benchmarks/router_vs_vllm.py). The replicas are engines the
job started (vLLM's or dualrun's), so what is spoken is small: a request with its whole body (Content-Length) in one
write; an answer with a Content-Length, chunked, or read to the connection's close. One request per connection at a
time; idle connections are kept per address and reused. A reused connection that breaks before the first byte of its
answer (the replica closed it while idle) is retried once on a new one; one idle longer than `IDLE_S` is not reused
(engines close theirs after 5 s: uvicorn's default).

Errors: `OSError` when the replica cannot be reached or breaks the answer off (refused, reset, closed, a malformed
answer: `UpstreamError`), `asyncio.TimeoutError` when no whole answer came within the call's timeout. A call that
is cancelled closes its connection (the answer may still come; it must not be read as the next call's).
"""
from __future__ import annotations

import asyncio
import socket
from typing import Mapping

IDLE_S = 4.0              # a connection idle longer is closed, not reused (below uvicorn's 5 s keep-alive)
OCTET_STREAM = "application/octet-stream"   # an answer without a Content-Type (as aiohttp's client reads it)


class UpstreamError(ConnectionError):
    """A replica broke a call off: the connection closed mid-answer, or the answer was not HTTP/1.x."""


class _Connection(asyncio.Protocol):
    """One kept-alive connection: bytes in `buf`, `wait()` until more arrive or it closes."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.received = False   # any byte of an answer yet (a call that got none may be tried anew)
        self.closed = False
        self.timed_out = False
        self.idle_since = 0.0
        self._waiter: asyncio.Future | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport   # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:   # (small writes go out at once: an answer is waited for after each)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self.received = True
        self._wake()

    def eof_received(self) -> bool:
        self.closed = True
        self._wake()
        return False   # (the transport closes)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        """Until more bytes arrive or the connection closes (`UpstreamError`, `TimeoutError` after a timeout)."""
        if self.closed:
            raise asyncio.TimeoutError() if self.timed_out else UpstreamError("the replica closed the connection")
        self._waiter = self.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def time_out(self) -> None:
        """The call's timeout: no answer will be read from this connection."""
        self.timed_out = True
        self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()
        self._wake()


class Upstream:
    """Calls to replicas by address (`host:port`); every request carries `headers` (the job's own, fixed)."""

    def __init__(self, headers: Mapping[str, str] | None = None) -> None:
        self._idle: dict[str, list[_Connection]] = {}
        self._fixed = _header_lines(headers or {})
        self._heads: dict[tuple[str, str | None], bytes] = {}   # (address, content type) -> Host and fixed lines

    async def request(self, address: str, method: str, path_qs: str, body: bytes | None = None,
                      content_type: str | None = None, timeout: float | None = None) -> tuple[int, bytes, str]:
        """(status, body, content type without parameters) of `method path_qs` at `address`."""
        head = self._heads.get((address, content_type))
        if head is None:
            head = self._head(address, content_type)
        body = body or b""
        message = b"".join((f"{method} {path_qs} HTTP/1.1\r\n".encode("latin-1"), head,
                            b"Content-Length: %d\r\n\r\n" % len(body) if body or method != "GET" else b"\r\n", body))
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        retry = True
        while True:
            conn, reused = await self._connection(address, loop, deadline, reuse=retry)
            timer = None if deadline is None else loop.call_at(deadline, conn.time_out)
            conn.received = False
            try:
                conn.transport.write(message)   # type: ignore[union-attr]
                answer, keep = await _answer(conn, method)
            except UpstreamError:
                conn.close()
                if retry and reused and not conn.received:   # closed while idle, before this call reached it
                    retry = False
                    self.forget(address)   # (its other idle ones likely with it): once more, on a new one
                    continue
                raise
            except BaseException:   # a timeout, a cancel: an answer may still come on this connection
                conn.close()
                raise
            finally:
                if timer is not None:
                    timer.cancel()
            if keep and not conn.closed:
                conn.idle_since = loop.time()
                self._idle.setdefault(address, []).append(conn)
            else:
                conn.close()
            return answer

    def forget(self, address: str) -> None:
        """Close the idle connections to `address` (its engine was replaced or removed)."""
        for conn in self._idle.pop(address, []):
            conn.close()

    def close(self) -> None:
        for address in list(self._idle):
            self.forget(address)

    def _head(self, address: str, content_type: str | None) -> bytes:
        head = _header_lines({"Host": address, "Content-Type": content_type}) + self._fixed
        if len(self._heads) < 256:   # (the addresses and types a router sees are a handful)
            self._heads[(address, content_type)] = head
        return head

    async def _connection(self, address: str, loop: asyncio.AbstractEventLoop, deadline: float | None,
                          reuse: bool = True) -> tuple[_Connection, bool]:
        idle = self._idle.get(address) if reuse else None
        now = None
        while idle:
            conn = idle.pop()
            now = now or loop.time()
            if not conn.closed and now - conn.idle_since < IDLE_S:
                return conn, True
            conn.close()
        host, _, port = address.rpartition(":")
        if not port.isdigit():
            raise UpstreamError(f"not a host:port: {address!r}")
        connect = loop.create_connection(lambda: _Connection(loop), host.strip("[]"), int(port))
        if deadline is None:
            _, conn = await connect
        else:
            _, conn = await asyncio.wait_for(connect, max(deadline - loop.time(), 0))
        return conn, False   # type: ignore[return-value]


async def _answer(conn: _Connection, method: str) -> tuple[tuple[int, bytes, str], bool]:
    """Read one answer off `conn`: ((status, body, content type), whether the connection may be reused)."""
    buf = conn.buf
    while True:   # (1xx answers before the real one are skipped)
        end = buf.find(b"\r\n\r\n")
        while end < 0:
            await conn.wait()
            end = buf.find(b"\r\n\r\n")
        lines = bytes(buf[:end]).split(b"\r\n")
        del buf[:end + 4]
        version, _, rest = lines[0].partition(b" ")
        try:
            status = int(rest[:3])
        except ValueError:
            raise UpstreamError(f"not an HTTP answer: {lines[0][:80]!r}") from None
        if not version.startswith(b"HTTP/1.") or status < 100:
            raise UpstreamError(f"not an HTTP/1.x answer: {lines[0][:80]!r}")
        if status >= 200:
            break
    length = chunked = None
    content_type, keep = OCTET_STREAM, version == b"HTTP/1.1"
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            try:
                length = int(value)
            except ValueError:
                raise UpstreamError(f"a bad Content-Length: {value[:40]!r}") from None
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
        elif name == b"content-type":
            content_type = value.split(b";", 1)[0].strip().lower().decode("latin-1") or OCTET_STREAM
        elif name == b"connection":
            token = value.strip().lower()
            keep = token == b"keep-alive" or (keep and token != b"close")
    if method == "HEAD" or status in (204, 304):
        body = b""
    elif chunked:
        body = await _chunked(conn)
    elif length is not None:
        while len(buf) < length:
            await conn.wait()
        body = bytes(buf[:length])
        del buf[:length]
    else:   # read to the close
        while True:
            try:
                await conn.wait()
            except UpstreamError:
                break
        body, keep = bytes(buf), False
        buf.clear()
    return (status, body, content_type), keep and not buf


async def _chunked(conn: _Connection) -> bytes:
    buf, parts = conn.buf, []
    while True:
        end = buf.find(b"\r\n")
        while end < 0:
            await conn.wait()
            end = buf.find(b"\r\n")
        try:
            size = int(bytes(buf[:end]).split(b";", 1)[0], 16)
        except ValueError:
            raise UpstreamError(f"a bad chunk size: {bytes(buf[:min(end, 40)])!r}") from None
        if size == 0:   # the last chunk, then trailers (if any) up to an empty line
            del buf[:end + 2]
            while True:
                if buf[:2] == b"\r\n":
                    del buf[:2]
                    return b"".join(parts)
                trailers = buf.find(b"\r\n\r\n")
                if trailers >= 0:
                    del buf[:trailers + 4]
                    return b"".join(parts)
                await conn.wait()
        while len(buf) < end + 2 + size + 2:
            await conn.wait()
        parts.append(bytes(buf[end + 2:end + 2 + size]))
        del buf[:end + 2 + size + 2]


def _header_lines(headers: Mapping[str, str | None]) -> bytes:
    """`Name: value` lines; a value with a line break of its own would be a header (or a request) of its own:
    refused (ValueError)."""
    for name, value in headers.items():
        if any(c in f"{name}{value}" for c in "\r\n"):
            raise ValueError(f"a header with a line break of its own: {name}: {value!r}")
    return "".join(f"{name}: {value}\r\n" for name, value in headers.items() if value is not None).encode("latin-1")
