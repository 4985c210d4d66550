"""Closed-loop HTTP load: `concurrency` requests in flight until `requests` have been answered; each one's latency.

Why closed-loop: a trainer's client keeps a fixed number of requests in flight (TRL sends a batch's prompts at
once and waits), so the question is what latency and requests/s a fixed number in flight gets. One aiohttp
session with a connection per request in flight (kept alive), on the caller's event loop; `urls` are taken in
turn (a client spreading over replicas itself, the baseline with no router).
"""
from __future__ import annotations

import asyncio
import itertools
import statistics
import time


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (inclusive method; the maximum for q=100)."""
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if q < 100 else max(values)


async def _closed_loop(urls: list[str], body: bytes, concurrency: int, requests: int, warmup: int) -> dict:
    import aiohttp

    headers = {"Content-Type": "application/json"}
    turn = itertools.cycle(urls)
    latencies: list[float] = []
    left = [warmup, requests]   # warm-up requests (untimed: connections opened), then timed ones
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    async with aiohttp.ClientSession(connector=connector, trust_env=False,
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def worker(timed: int) -> None:
            while left[timed] > 0:
                left[timed] -= 1
                t = time.perf_counter()
                async with session.post(next(turn), data=body, headers=headers) as resp:
                    await resp.read()
                    if resp.status != 200:
                        raise RuntimeError(f"{resp.url} answered {resp.status}: {(await resp.text())[:300]}")
                if timed:
                    latencies.append(time.perf_counter() - t)

        await asyncio.gather(*(worker(0) for _ in range(concurrency)))
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(1) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ms = [x * 1000 for x in latencies]
    return {"p50": pct(ms, 50), "p99": pct(ms, 99), "rps": len(ms) / wall, "n": len(ms), "wall": wall}


def closed_loop(urls: list[str], body: bytes, concurrency: int, requests: int, warmup: int | None = None) -> dict:
    """p50 and p99 latency (ms), requests/s, count and wall (s) of `requests` POSTs of `body`, `concurrency` in
    flight (after `warmup` untimed ones, default one per connection)."""
    return asyncio.run(_closed_loop(urls, body, concurrency, requests,
                                    concurrency if warmup is None else warmup))
