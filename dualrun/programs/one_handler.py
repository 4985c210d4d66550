"""One request handler served by aiohttp's low-level server until SIGINT or SIGTERM.

Why not `web.run_app(Application)`: a server whose every request goes to one handler pays, per request, for an
Application it does not use (the URL dispatcher's regex match, match info, the middleware chain, a `web.Request`
on top of the `BaseRequest`); the router's hot path is mostly that kind of per-request CPU. `web.Server` calls the
handler with the `BaseRequest` directly; what the Application did for us that a client can notice is kept here:
the request body limit and the `Expect: 100-continue` answer. Start-up and shut-down keep run_app's order: `start`
before the port opens, the handlers in flight given the runner's 60 s to end, then `stop`.
"""
from __future__ import annotations

import asyncio
import gc
import signal
from typing import Awaitable, Callable

from aiohttp import web
from aiohttp.http import HttpVersion11

Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]
# Allocations between two collections of the youngest generation (Python's default: 700). A request allocates
# thousands of short-lived objects (aiohttp's request, response, headers, futures): at 700 the collector ran every
# few requests and walked the requests in flight each time, about 8 % of the router's instructions.
YOUNG_GENERATION = 10_000


def event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop where it is installed (it comes with vLLM): a server's time is the loop's and the sockets'."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def fewer_collections() -> None:
    """Once started: what was loaded so far (modules, the session) is left out of every collection from now on
    (`gc.freeze`), and the youngest generation is collected every `YOUNG_GENERATION` allocations. Memory grows by
    at most that many young objects; reference cycles are still collected."""
    gc.freeze()
    gc.set_threshold(YOUNG_GENERATION, *gc.get_threshold()[1:])


async def expect_continue(request: web.BaseRequest) -> web.StreamResponse | None:
    """What aiohttp's dispatcher does for an `Expect` header (its `_default_expect_handler`): `100-continue` is
    answered so that the client sends its body; any other expectation is a 417."""
    expect = request.headers.get("Expect", "")
    if request.version != HttpVersion11:
        return None
    if expect.lower() != "100-continue":
        return web.Response(status=417, text=f"Unknown Expect: {expect}")
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0   # (as aiohttp's: the answer's own size starts after it)
    await request.writer.drain()
    return None


async def serve(handler: Handler, host: str, port: int, *, start: Callable[[], Awaitable[None]],
                stop: Callable[[], Awaitable[None]], client_max_size: int, backlog: int) -> None:
    """Serve `handler` on host:port until SIGINT or SIGTERM; `start()` runs before the port opens, `stop()` after
    the server has closed."""
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, done.set)

    def request_factory(message, payload, protocol, writer, task) -> web.BaseRequest:  # type: ignore[no-untyped-def]
        return web.BaseRequest(message, payload, protocol, writer, task, loop, client_max_size=client_max_size)

    async def expecting(request: web.BaseRequest) -> web.StreamResponse:
        answer = await expect_continue(request)
        return answer if answer is not None else await handler(request)

    def handle(request: web.BaseRequest) -> Awaitable[web.StreamResponse]:
        # (not a coroutine of its own: the handler's is awaited directly, one frame less on every resumption)
        return expecting(request) if request.headers.get("Expect") else handler(request)   # (as aiohttp's: if set)

    runner = web.ServerRunner(web.Server(handle, request_factory=request_factory, access_log=None))
    await runner.setup()
    await start()
    fewer_collections()
    try:
        await web.TCPSite(runner, host, port, backlog=backlog).start()
        await done.wait()
    finally:
        await runner.cleanup()
        await stop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def run(serving: Awaitable[None]) -> None:
    """Run `serving` (a `serve(...)`) to its end on uvloop where installed, then close the loop cleanly."""
    loop = event_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(serving)
        tasks = asyncio.all_tasks(loop)
        for task in tasks:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        loop.close()
