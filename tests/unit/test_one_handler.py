"""The router's server (dualrun/programs/one_handler.py): aiohttp's low-level server with one handler keeps what the
Application gave a client — any method and path reach the handler, a body up to the limit given (aiohttp's own
default refuses more than 1 MiB), `Expect: 100-continue` answered, another expectation refused with 417, an empty
one ignored — and its lifecycle: `start` before the port opens, `stop` after SIGTERM, the collector's young
generation raised meanwhile. In-process, real sockets on loopback."""
from __future__ import annotations

import asyncio
import gc
import os
import signal

from aiohttp import ClientSession, web

from dualrun.programs import one_handler
from helpers import free_port


async def _exchange(port: int, head: bytes, body: bytes) -> tuple[bytes, bytes]:
    """Send `head`; the server's first answer (a 100 Continue, or the final one), then `body` and what follows."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)
    await writer.drain()
    first = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    rest = b""
    if first.startswith(b"HTTP/1.1 100"):
        writer.write(body)
        await writer.drain()
        rest = await asyncio.wait_for(reader.readuntil(b"ok"), 10)
    writer.close()
    return first, rest


def test_every_request_reaches_the_one_handler_with_the_body_limit_and_expect_then_sigterm_stops_it():
    seen: list[tuple[str, str, int]] = []
    order: list[str] = []
    port = free_port()
    thresholds = gc.get_threshold()

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        body = await request.read()
        seen.append((request.method, request.path_qs, len(body)))
        return web.Response(text="ok")

    async def start() -> None:
        order.append("start")

    async def stop() -> None:
        order.append("stop")

    async def client() -> dict:
        out: dict = {}
        for _ in range(200):
            try:
                await (await asyncio.open_connection("127.0.0.1", port))[1].drain()
                break
            except OSError:
                await asyncio.sleep(0.05)
        out["young"] = gc.get_threshold()[0]
        async with ClientSession() as session:
            async with session.put(f"http://127.0.0.1:{port}/any/path?x=1", data=b"b" * (3 * 2 ** 20)) as resp:
                out["big"] = resp.status
            async with session.post(f"http://127.0.0.1:{port}/v1/x", data=b"b" * (5 * 2 ** 20)) as resp:
                out["too_big"] = resp.status
        out["continue"] = await _exchange(port, b"POST /c HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                                                b"Expect: 100-continue\r\n\r\n", b"hello")
        out["unknown"] = await _exchange(port, b"POST /u HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                                               b"Expect: something\r\n\r\n", b"hello")
        out["empty"] = await _exchange(port, b"POST /e HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                                             b"Expect: \r\n\r\nhello", b"")
        os.kill(os.getpid(), signal.SIGTERM)   # the loop's handler ends serve()
        return out

    async def main() -> dict:
        answers = asyncio.ensure_future(client())
        await asyncio.wait_for(one_handler.serve(handler, "127.0.0.1", port, start=start, stop=stop,
                                                 client_max_size=4 * 2 ** 20, backlog=16), 60)
        return await answers

    try:
        out = asyncio.run(main())
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
    assert out["young"] == one_handler.YOUNG_GENERATION
    assert out["big"] == 200 and out["too_big"] == 413
    first, rest = out["continue"]
    assert first.startswith(b"HTTP/1.1 100 Continue") and rest.startswith(b"HTTP/1.1 200")
    first, rest = out["unknown"]
    assert first.startswith(b"HTTP/1.1 417") and rest == b""
    assert ("PUT", "/any/path?x=1", 3 * 2 ** 20) in seen and ("POST", "/c", 5) in seen
    assert not any(path == "/u" for _, path, _ in seen)
    assert out["empty"][0].startswith(b"HTTP/1.1 200") and ("POST", "/e", 5) in seen   # an empty Expect: none
    assert order == ["start", "stop"]
