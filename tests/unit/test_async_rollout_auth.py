"""AsyncGRPOTrainer's rollout child generates on its own aiohttp session, in a process TRL spawns (so none of the
rank's hooks are there): its requests to the job's rollout server carry the job's secret and the role's `--api-key`,
its requests elsewhere neither. The child here is TRL's own `_child_main`, spawned as TRL's AsyncRolloutWorker
spawns it (`target=_child_main`, the spawn context), with a loop that posts the way TRL's loop does."""
from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dualrun.contract import protocol
from dualrun.contract.job_token import HEADER
from dualrun.rank import server_auth

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


class RecordingLoop:
    """Stands in for TRL's `_AsyncRolloutLoop` (its `loop_cls` argument): posts to each URL as that loop does, on
    a session built from the worker module's `aiohttp`."""

    def __init__(self, *, urls: list[str], **_: object) -> None:
        self.urls = urls

    def run(self) -> None:
        from trl.experimental.async_grpo import async_rollout_worker as worker

        async def post_all() -> None:
            aiohttp = worker.aiohttp
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=2)) as session:
                for url in self.urls:
                    async with session.post(url, json={"prompt": [1, 2]}) as response:
                        response.raise_for_status()

        asyncio.run(post_all())


def _recording_server(seen: list[dict]) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:   # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            seen.append(dict(self.headers))
            body = json.dumps({}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_the_spawned_rollout_child_sends_the_jobs_headers_to_its_servers_only(monkeypatch):
    worker = pytest.importorskip("trl.experimental.async_grpo.async_rollout_worker")
    rollout_seen: list[dict] = []
    other_seen: list[dict] = []
    rollout, other = _recording_server(rollout_seen), _recording_server(other_seen)
    try:
        monkeypatch.setenv(protocol.address_env("rollout"), f"127.0.0.1:{rollout.server_port}")
        monkeypatch.setenv(protocol.JOB_TOKEN, "job-secret")
        monkeypatch.setenv(protocol.api_key_env("rollout"), "user-key")
        monkeypatch.setattr(worker, "_child_main", worker._child_main)   # restored after the test
        server_auth.install_rollout_worker(worker)
        assert worker._child_main is server_auth.async_rollout_child
        ctx = mp.get_context("spawn")
        urls = [f"http://127.0.0.1:{rollout.server_port}/v1/completions", f"http://127.0.0.1:{other.server_port}/x"]
        # held here until the child ends, as TRL's worker holds them (the process drops its args once started)
        shared = (ctx.Queue(), ctx.Value("i", 0), ctx.Event(), ctx.Event(), ctx.Value("d", 0.0), ctx.Event(),
                  ctx.Queue(), ctx.Queue())
        child = ctx.Process(target=worker._child_main, args=(RecordingLoop, {"urls": urls}, *shared))
        child.start()
        child.join(150)
        assert child.exitcode == 0
    finally:
        monkeypatch.delattr(worker, "_dualrun_child_main", raising=False)
        rollout.shutdown()
        other.shutdown()
    [to_rollout], [to_other] = rollout_seen, other_seen
    assert to_rollout.get(HEADER) == "job-secret" and to_rollout.get("Authorization") == "Bearer user-key"
    assert HEADER not in to_other and "Authorization" not in to_other
