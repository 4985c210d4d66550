"""Several engine replicas behind one host:port, for TRL's server protocol.

    python -m dualrun.servers.router --host 127.0.0.1 --port 8000 --replica 127.0.0.1:8001 --replica 127.0.0.1:8002

Why: TRL's trainers take one server address, and vLLM 0.14+ refuses data parallelism for dense models inside one
server; a role with more GPUs than one engine needs runs several engines, and this router makes them one address.
What each endpoint gets is the table in `routing.py`; this module only moves bytes (aiohttp, one kept-alive
connection pool to the replicas). Both launchers start it (a ServerProcess like any server: health-checked,
logged, watched, stopped with the servers) in front of a separate role's replicas once they are healthy; its
`host:port` is the one the trainers get.

Known differences from one engine: a split request with sampling and a `seed` gives each part the same seed, so
sampled completions differ from one engine's (greedy ones are identical); `/server_info` and `/v1/models` are
the first replica's; a `stream: true` completion goes to one replica whole.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import dataclass
from typing import Any, Sequence

from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector, web

from dualrun.interpreter import PYTHON
from dualrun.servers import routing

HEALTH_TIMEOUT_S = 2.0


@dataclass
class Replica:
    address: str
    requests: int = 0      # every forwarded call, health probes included
    served: int = 0        # generation, scoring and weight-transfer calls (what the replica is there for)
    in_flight: int = 0
    errors: int = 0

    @property
    def url(self) -> str:
        return f"http://{self.address}"


class ReplicaError(Exception):
    """A replica failed a request the router needed: the answer names it."""

    def __init__(self, index: int, replica: Replica, status: int, text: str) -> None:
        self.status = status if status >= 400 else 502
        super().__init__(f"replica {index} ({replica.address}) answered {status}: {text[:500]}")


class Router:
    """The aiohttp app: one handler that looks the request up in `routing.ROUTES` and treats it accordingly."""

    def __init__(self, replicas: Sequence[str], timeout_s: float | None = None) -> None:
        if not replicas:
            raise ValueError("the router needs at least one replica address")
        self.replicas = [Replica(a) for a in replicas]
        self.timeout = ClientTimeout(total=timeout_s)
        self.session: ClientSession | None = None
        self._next = 0

    # -- lifecycle --------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=1024 ** 3)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, _: web.Application) -> None:
        self.session = ClientSession(connector=TCPConnector(limit=0), timeout=self.timeout)

    async def _close(self, _: web.Application) -> None:
        if self.session is not None:
            await self.session.close()
        # the last line of its log: how the work was spread (the launcher stops the router with the servers)
        print(f"dualrun router: served per replica: {[r.served for r in self.replicas]}", file=sys.stderr, flush=True)

    # -- talking to replicas ------------------------------------------------------------------------------
    async def call(self, index: int, method: str, path_qs: str, body: bytes | None = None,
                   headers: dict | None = None, timeout: ClientTimeout | None = None) -> tuple[int, bytes, str]:
        replica = self.replicas[index]
        replica.requests += 1
        if routing.route(method, path_qs) not in (routing.HEALTH, routing.WORLD_SIZE, routing.FIRST):
            replica.served += 1
        replica.in_flight += 1
        try:
            assert self.session is not None
            async with self.session.request(method, replica.url + path_qs, data=body, headers=headers,
                                            timeout=timeout or self.timeout) as resp:
                data = await resp.read()
                if resp.status >= 400:
                    replica.errors += 1
                return resp.status, data, resp.content_type
        except (ClientError, OSError, asyncio.TimeoutError) as e:  # the replica is unreachable: a 502
            replica.errors += 1
            raise ReplicaError(index, replica, 502, f"{type(e).__name__}: {e}") from None
        finally:
            replica.in_flight -= 1

    async def call_json(self, index: int, method: str, path_qs: str, payload: Any = None) -> Any:
        body = None if payload is None else json.dumps(payload).encode()
        status, data, _ = await self.call(index, method, path_qs, body, {"Content-Type": "application/json"})
        if status != 200:
            raise ReplicaError(index, self.replicas[index], status, data.decode(errors="replace"))
        return json.loads(data or b"null")

    def pick(self) -> int:
        """The least busy replica; ties go round-robin, so sequential requests still visit every replica."""
        n = len(self.replicas)
        start, self._next = self._next, (self._next + 1) % n
        return min(range(n), key=lambda i: (self.replicas[i].in_flight, (i - start) % n))

    async def world_sizes(self) -> list[int]:
        answers = await asyncio.gather(*(self.call_json(i, "GET", "/get_world_size")
                                         for i in range(len(self.replicas))))
        return [int(a["world_size"]) for a in answers]

    # -- the handler ----------------------------------------------------------------------------------------
    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if request.method == "GET" and path.rstrip("/") == routing.STATS_PATH:
            return web.json_response({"replicas": [vars(r) for r in self.replicas]})
        treatment = routing.route(request.method, path)
        if treatment is None:
            return _error(404, routing.unknown_endpoint(request.method, path))
        body = await request.read()
        try:
            if treatment == routing.HEALTH:
                return await self.health()
            if treatment == routing.WORLD_SIZE:
                return web.json_response({"world_size": sum(await self.world_sizes())})
            if treatment == routing.FIRST:
                return _passthrough(*await self.call(0, request.method, request.path_qs, body or None))
            if treatment == routing.SPLIT:
                return await self.completions(request, body)
            if treatment == routing.ONE:
                return _passthrough(*await self.call(self.pick(), request.method, request.path_qs, body,
                                                     _content_type(request)))
            if treatment == routing.INIT_WEIGHTS:
                bodies = routing.init_bodies(_json(body), await self.world_sizes())
                return await self.to_all(request.path_qs, [json.dumps(b).encode() for b in bodies])
            return await self.to_all(request.path_qs, [body] * len(self.replicas))
        except ReplicaError as e:
            return _error(e.status, str(e))
        except ValueError as e:
            return _error(400, str(e))

    async def health(self) -> web.Response:
        timeout = ClientTimeout(total=HEALTH_TIMEOUT_S)

        async def probe(i: int) -> str | None:
            try:
                status, _, _ = await self.call(i, "GET", "/health", timeout=timeout)
            except ReplicaError as e:
                return str(e)
            return None if status == 200 else f"replica {i} ({self.replicas[i].address}) answered {status}"

        problems = [p for p in await asyncio.gather(*(probe(i) for i in range(len(self.replicas)))) if p]
        if problems:
            return web.json_response({"status": "unhealthy", "problems": problems}, status=503)
        return web.json_response({"status": "ok", "replicas": len(self.replicas)})

    async def completions(self, request: web.Request, body: bytes) -> web.Response:
        payload = _json(body)
        prompts = routing.prompts_of(payload)
        if prompts is None or len(prompts) == 1 or len(self.replicas) == 1 or payload.get("stream"):
            return _passthrough(*await self.call(self.pick(), "POST", request.path_qs, body, _content_type(request)))
        parts = routing.split_completion(payload, prompts, len(self.replicas))
        first = self.pick()
        targets = [(first + i) % len(self.replicas) for i in range(len(parts))]
        answers = await asyncio.gather(*(self.call_json(t, "POST", request.path_qs, part)
                                         for t, (_, part) in zip(targets, parts)))
        merged = routing.merge_completions([(start, a) for (start, _), a in zip(parts, answers)],
                                           int(payload.get("n") or 1))
        return web.json_response(merged, dumps=_dumps)

    async def to_all(self, path_qs: str, bodies: list[bytes]) -> web.Response:
        """Every replica at once (NCCL calls block until all members join); all must answer 200."""
        headers = {"Content-Type": "application/json"}
        results = await asyncio.gather(*(self.call(i, "POST", path_qs, b or None, headers)
                                         for i, b in enumerate(bodies)), return_exceptions=True)
        problems = []
        for i, result in enumerate(results):
            if isinstance(result, BaseException):
                problems.append(str(result))
            elif result[0] != 200:
                problems.append(str(ReplicaError(i, self.replicas[i], result[0], result[1].decode(errors="replace"))))
        if problems:
            return _error(502, "; ".join(problems))
        return _passthrough(*results[0])  # type: ignore[misc]


def _json(body: bytes) -> dict:
    try:
        payload = json.loads(body or b"{}")
    except json.JSONDecodeError as e:
        raise ValueError(f"the request body is not JSON: {e}") from None
    if not isinstance(payload, dict):
        raise ValueError("the request body must be a JSON object")
    return payload


def _dumps(obj: Any) -> str:
    return json.dumps(obj, allow_nan=True)  # logprobs may be -inf, as the engines send them


def _content_type(request: web.Request) -> dict:
    return {"Content-Type": request.headers.get("Content-Type", "application/json")}


def _passthrough(status: int, data: bytes, content_type: str) -> web.Response:
    return web.Response(status=status, body=data, content_type=content_type or "application/json")


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def router_argv(host: str, port: int, replicas: Sequence[str], timeout_s: float | None = None) -> list[str]:
    """The router's command line (for a ServerProcess; health at `/health`)."""
    argv = [PYTHON, "-m", "dualrun.servers.router", "--host", host, "--port", str(port)]
    for address in replicas:
        argv += ["--replica", address]
    return argv + ([] if timeout_s is None else ["--timeout-s", str(timeout_s)])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="dualrun.servers.router", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--replica", action="append", default=[], help="host:port of a replica (repeat)")
    parser.add_argument("--timeout-s", type=float, default=None, help="per forwarded request (default: none)")
    args = parser.parse_args(argv)
    if not args.replica:
        parser.error("at least one --replica host:port")
    router = Router(args.replica, args.timeout_s)
    print(f"dualrun router: serving http://{args.host}:{args.port} for {len(args.replica)} replicas: "
          f"{' '.join(args.replica)}", file=sys.stderr, flush=True)
    web.run_app(router.app(), host=args.host, port=args.port, print=None, access_log=None,
                handle_signals=True)


if __name__ == "__main__":
    main()
