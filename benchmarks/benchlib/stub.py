"""A replica that answers at once (a benchmark's stand-in for an engine), so that what is timed is transport.

    python benchmarks/benchlib/stub.py PORT

aiohttp on one event loop, as a real engine's HTTP front is (a thread per connection would not hold 256 in
flight on 2 cores). `POST /v1/completions` reads the body and answers one choice per prompt (a list of token-id
lists is that many prompts), so a split request's parts and a whole one get answers of the right size; every GET
answers 200 (`/health`, `/get_world_size`, `/v1/models` as the routers probe them).
"""
from __future__ import annotations

import json
import sys

from aiohttp import web

MODELS = {"object": "list", "data": [{"id": "stub", "object": "model", "owned_by": "bench"}]}


def _prompts(body: dict) -> int:
    raw = body.get("prompt")
    return len(raw) if isinstance(raw, list) and raw and isinstance(raw[0], (list, str)) else 1


async def _get(request: web.Request) -> web.Response:
    path = request.path
    if path.startswith("/get_world_size"):
        return web.json_response({"world_size": 1})
    if path.startswith("/v1/models"):
        return web.json_response(MODELS)
    return web.json_response({"status": "ok"})


async def _post(request: web.Request) -> web.Response:
    body = json.loads(await request.read() or b"{}")
    choices = [{"index": i, "text": "a b c", "token_ids": [1, 2, 3], "finish_reason": "length"}
               for i in range(_prompts(body))]
    return web.json_response({"id": "cmpl-stub", "object": "text_completion", "model": "stub", "choices": choices,
                              "usage": {"prompt_tokens": 3 * len(choices), "completion_tokens": 3 * len(choices),
                                        "total_tokens": 6 * len(choices)}})


def main(port: int) -> None:
    app = web.Application()
    app.router.add_get("/{tail:.*}", _get)
    app.router.add_post("/{tail:.*}", _post)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None, backlog=1024)  # 256 in flight


if __name__ == "__main__":
    main(int(sys.argv[1]))
