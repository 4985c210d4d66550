"""The router's weight-sync fan-out when a replica joins mid-sync: the two races the fleet benchmark found
(benchmarks/results/fleet_growth.md), replayed call by call. In-process: a real Router served by aiohttp on
loopback in front of stub engines that answer the weight-transfer calls as vLLM does (a finish without its start is
refused: 500) and record each one. No timing: the order of the calls is the test."""
from __future__ import annotations

import asyncio
import json

from aiohttp import ClientSession, web

from dualrun.contract import protocol
from dualrun.programs.rotation import SPARE
from dualrun.programs.router import Router

WEIGHT_CALLS = ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update",
                "/shutdown_weight_transfer_engine")


class Engine:
    """A stub vLLM server with one worker: records every weight-transfer call, refuses a finish without a start."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.open = False
        self.runner: web.AppRunner | None = None
        self.address = ""

    async def answer(self, request: web.Request) -> web.Response:
        path = request.path
        if request.method == "GET":
            return web.json_response({"world_size": 1} if path == "/get_world_size" else {})
        body = json.loads(await request.read() or b"{}")
        self.calls.append((path, body))
        if path == "/start_weight_update":
            self.open = True
        elif path == "/finish_weight_update":
            if not self.open:   # vLLM's answer
                return web.json_response({"error": "finish_weight_update called without a matching "
                                                   "start_weight_update"}, status=500)
            self.open = False
        return web.json_response({})

    def paths(self) -> list[str]:
        return [path for path, _ in self.calls if path in WEIGHT_CALLS]

    async def start(self) -> "Engine":
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.answer)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.address = f"127.0.0.1:{self.runner.addresses[0][1]}"
        return self


async def _serve(router: Router) -> tuple[web.ServerRunner, str]:
    runner = web.ServerRunner(web.Server(router.handle))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def test_a_join_during_an_update_or_a_re_form_waits_for_the_next_re_form_held(monkeypatch):
    monkeypatch.delenv(protocol.JOB_TOKEN, raising=False)

    async def main() -> None:
        engines = [await Engine().start() for _ in range(4)]
        router = Router([engines[0].address, engines[1].address, SPARE, SPARE], probe_interval_s=0.05)
        await router._open(None)
        runner, base = await _serve(router)
        session = ClientSession()

        async def post(path: str, payload: dict | None = None) -> tuple[int, dict]:
            async with session.post(base + path, json=payload or {}) as r:
                return r.status, await r.json()

        async def get(path: str) -> dict:
            async with session.get(base + path) as r:
                assert r.status == 200
                return await r.json()

        async def init(world_size: int) -> tuple[int, dict]:
            return await post("/init_weight_transfer_engine", {"init_info": {"rank_offset": 1,
                                                                             "world_size": world_size}})

        async def in_rotation(expected: list[int]) -> None:
            for _ in range(400):
                if router.table.in_rotation() == expected:
                    return
                await asyncio.sleep(0.025)
            assert router.table.in_rotation() == expected

        try:
            assert (await get("/get_world_size"))["world_size"] == 2            # the trainer forms the group
            assert (await init(3))[0] == 200
            # (1) replica 2 starts after the update's start, before its finish
            assert (await post("/start_weight_update"))[0] == 200
            router.control(2, "replace", {"address": engines[2].address, "hold": True})
            assert (await post("/update_weights"))[0] == 200
            status, answer = await post("/finish_weight_update")
            assert status == 200, answer                                    # (it was 502: replica 2 refused it)
            assert engines[2].calls == [] and router.replicas[2].hold
            expected = ["/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                        "/finish_weight_update"]
            assert engines[0].paths() == engines[1].paths() == expected
            assert await get(protocol.ROUTER_MEMBERSHIP_PATH) == {"membership": 1, "members": [0, 1, 2],
                                                                    "group": [0, 1]}
            # (2) the re-form its join asks for; replica 3 starts between the world size and the init
            assert (await post("/shutdown_weight_transfer_engine"))[0] == 200   # the old group's members leave it
            assert engines[2].calls == []
            assert (await get("/get_world_size"))["world_size"] == 3
            router.control(3, "replace", {"address": engines[3].address, "hold": True})
            status, answer = await init(4)                                  # (it was 400: counted 4 workers)
            assert status == 200, answer
            offsets = [e.calls[-1][1]["init_info"]["rank_offset"] for e in engines[:3]]
            assert offsets == [1, 2, 3] and engines[3].calls == []
            for path in ("/start_weight_update", "/update_weights", "/finish_weight_update"):
                assert (await post(path))[0] == 200, path
            await in_rotation([0, 1, 2])                                    # replica 2 holds the weights: serves
            assert engines[3].calls == [] and router.replicas[3].hold       # replica 3: held, for the next re-form
            assert (await get(protocol.ROUTER_MEMBERSHIP_PATH))["group"] == [0, 1, 2]
            # a trainer whose count is stale is refused at once, and no engine is asked to join
            assert (await get("/get_world_size"))["world_size"] == 4
            before = [len(e.calls) for e in engines]
            status, answer = await init(4)
            assert status == 400 and "init_info.world_size 4 cannot hold rank_offset 1 plus the 4 workers" in \
                answer["error"]["message"], answer
            assert [len(e.calls) for e in engines] == before
            assert (await init(5))[0] == 200 and engines[3].paths() == ["/init_weight_transfer_engine"]
        finally:
            await session.close()
            await runner.cleanup()
            await router._close(None)
            for engine in engines:
                assert engine.runner is not None
                await engine.runner.cleanup()

    asyncio.run(main())
