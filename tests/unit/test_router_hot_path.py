"""The router's per-request path does only the work a request needs: forwarding one starts no task of its own (the
abort of a replica leaving the rotation cancels the task awaiting it instead), and a call carries the job's headers
(upstream.py's, built once). In-process: a real Router and real aiohttp replicas on loopback, in one event loop. No
timing here: what it saves is measured in benchmarks/router_vs_vllm.py."""
from __future__ import annotations

import asyncio
import json

from aiohttp import ClientSession, web

from dualrun.contract import job_token, protocol
from dualrun.programs.router import JSON, Router

BODY = json.dumps({"model": "m", "prompt": [1, 2, 3], "max_tokens": 1}).encode()


async def _replica(hang: asyncio.Event | None = None, status: int = 200,
                   seen: list | None = None) -> tuple[web.AppRunner, str]:
    """A replica on a free loopback port answering every POST at once (or, given `hang`, not before it is set),
    with `status` (a text body when not 200); `seen` gets each request's Content-Type."""
    async def answer(request: web.Request) -> web.Response:
        await request.read()
        if seen is not None:
            seen.append(request.headers.get("Content-Type"))
        if hang is not None:
            await hang.wait()
        if status != 200:
            return web.Response(status=status, text="sick")
        return web.json_response({"choices": [{"index": 0, "text": "x"}]})

    app = web.Application()
    app.router.add_post("/{tail:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"127.0.0.1:{port}"


def _counting_tasks(loop: asyncio.AbstractEventLoop) -> list[int]:
    """Count every task the loop starts from now on (count[0])."""
    count = [0]

    def factory(loop, coro, **kwargs):
        count[0] += 1
        return asyncio.Task(coro, loop=loop, **kwargs)

    loop.set_task_factory(factory)
    return count


def test_forwarding_a_request_starts_no_task_of_its_own():
    async def main():
        runner, address = await _replica()
        router = Router([address], probe_interval_s=0)
        await router._open(None)
        try:
            count = _counting_tasks(asyncio.get_running_loop())
            url = f"http://{address}/v1/completions"
            async with ClientSession() as direct:   # what aiohttp's client itself starts per request
                for _ in range(3):   # connections opened before counting
                    async with direct.post(url, data=BODY) as resp:
                        await resp.read()
                    await router.forward("POST", "/v1/completions", BODY, JSON)
                count[0] = 0
                for _ in range(20):
                    async with direct.post(url, data=BODY) as resp:
                        await resp.read()
                by_client = count[0]
                count[0] = 0
                for _ in range(20):
                    status, _, _ = await router.forward("POST", "/v1/completions", BODY, JSON)
                    assert status == 200
                by_router = count[0]
        finally:
            asyncio.get_running_loop().set_task_factory(None)
            await router._close(None)
            await runner.cleanup()
        # the old path started one task per attempt on top of the client's own
        assert by_router <= by_client, (by_router, by_client)

    asyncio.run(main())


def test_an_abort_moves_the_request_in_flight_to_another_replica_and_leaves_its_task_uncancelled():
    async def main():
        hang = asyncio.Event()
        hung, hung_address = await _replica(hang)
        good, good_address = await _replica()
        router = Router([hung_address, good_address], probe_interval_s=0)
        await router._open(None)
        try:
            async def request():
                answer = await router.forward("POST", "/v1/completions", BODY, JSON, prefer=0)
                await asyncio.sleep(0)   # a cancel left pending by the abort would land here
                return answer, asyncio.current_task().cancelling() if hasattr(asyncio.Task, "cancelling") else 0

            task = asyncio.ensure_future(request())
            for _ in range(1000):   # until the request is on the hung replica
                if router.replicas[0].in_flight or task.done():
                    break
                await asyncio.sleep(0.01)
            assert router.replicas[0].in_flight == 1, task
            router.control(0, "remove", {"reason": "test: the launcher took it out"})   # LAUNCHER aborts
            (status, data, _), cancelling = await asyncio.wait_for(task, 10)
            assert status == 200 and json.loads(data)["choices"][0]["text"] == "x"
            assert cancelling == 0
            assert router.replicas[1].served == 1 and not router.replicas[0].in_rotation
            assert router._aborted == set() and router._abort == [set(), set()]
        finally:
            hang.set()
            await router._close(None)
            await hung.cleanup()
            await good.cleanup()

    asyncio.run(main())


def test_a_call_carries_the_jobs_secret_the_api_key_and_its_bodys_type(monkeypatch):
    monkeypatch.setenv(protocol.JOB_TOKEN, "s" * 43)

    async def main():
        seen: list = []

        async def answer(request: web.Request) -> web.Response:
            seen.append((dict(request.headers), await request.read()))
            return web.json_response({"ok": 1})

        app = web.Application()
        app.router.add_post("/{tail:.*}", answer)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        address = f"127.0.0.1:{runner.addresses[0][1]}"
        router = Router([address], probe_interval_s=0, api_key="k")
        try:
            assert (await router.call(0, "POST", "/v1/completions", BODY, JSON))[0] == 200
            assert (await router.call(0, "POST", "/v1/completions", b"x", "text/plain"))[0] == 200
        finally:
            await router._close(None)
            await runner.cleanup()
        (first, body), (second, _) = seen
        assert body == BODY and first["Host"] == address and first["Content-Length"] == str(len(BODY))
        assert first[job_token.HEADER] == "s" * 43 and first["Authorization"] == "Bearer k"
        assert first["Content-Type"] == JSON and second["Content-Type"] == "text/plain"

    asyncio.run(main())


def test_a_request_retried_after_a_5xx_carries_its_own_content_type_not_the_answers():
    async def main():
        seen: list = []
        sick, sick_address = await _replica(status=500, seen=seen)
        good, good_address = await _replica(seen=seen)
        router = Router([sick_address, good_address], probe_interval_s=0)
        await router._open(None)
        try:
            status, _, answer_type = await router.forward("POST", "/v1/completions", BODY, JSON, prefer=0)
            assert (status, answer_type) == (200, JSON)
            assert seen == [JSON, JSON]
        finally:
            await router._close(None)
            await sick.cleanup()
            await good.cleanup()

    asyncio.run(main())
