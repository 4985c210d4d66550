"""Several engine replicas behind one host:port, for TRL's server protocol.

    python -m dualrun.programs.router --host 127.0.0.1 --port 8000 --replica 127.0.0.1:8001 --replica 127.0.0.1:8002

Why: TRL's trainers take one server address, and vLLM 0.14+ refuses data parallelism for dense models inside one
server; a role with more GPUs than one engine needs runs several engines, and this router makes them one address.
What each endpoint gets is the table in `routing.py`; this module only moves bytes (aiohttp's low-level server with
this one handler, `one_handler.py`; kept-alive connections of its own to the replicas, `upstream.py`). Both
launchers start it (a ServerProcess like any server: health-checked, logged, watched, stopped with the servers) in
front of a separate role's replicas once they are healthy; its `host:port` is the one the trainers get.

A replica that fails — connection refused or reset, a 5xx, no answer within `--request-timeout-s` (the role's
`request_timeout_s`), a failed health probe (every replica is probed about once a second) — leaves the rotation at
once and the request in flight goes to another replica (generation and scoring are safe to repeat: the same body);
`rotation.py` holds the rules, and the launcher's say over them (`routing.CONTROL_PATH`). The weight-transfer
fan-out is not retried: a replica failing there is the call's error. It goes to the weight-sync group, one snapshot
of the members (`rotation.in_group`), changed only by a re-form (the world size counts, the init forms): a replica
the launcher removed (dead, being restarted) is left out at once, one that joins waits for the next re-form (which
`protocol.ROUTER_MEMBERSHIP_PATH`'s new membership asks the trainer's side for) and, held until it has the
trainer's weights, is restored once it completes its first update.

A split request answers as one engine: a request's `seed` seeds each of its prompts in any part, and on CPU a
prompt's answer does not depend on its batch-mates (docs/concepts.md, "The same seed, the same training"). But
`/server_info` and `/v1/models` are the first replica's; a `stream: true` completion goes to one replica whole.
"""
from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import os
import sys
import time
from typing import Any, Sequence

from aiohttp import web

from dualrun.contract import job_token, protocol
from dualrun.config.cross_keys import host_port
from dualrun.light.noise import Noise
from dualrun.programs import guard, one_handler, rotation, upstream
from dualrun.programs import routing
from dualrun.programs.client_noise import quiet_client_trouble
from dualrun.programs.rotation import PROBE_INTERVAL_S, PROBE_TIMEOUT_S, Replica

JSON = "application/json"
SERVES = (routing.SPLIT, routing.ONE)   # what a replica is there for: a request of these is one it served
# the trainer's step the request a handler serves carried (protocol.STEP_HEADER), for the table's `served`
_STEP: contextvars.ContextVar[int | None] = contextvars.ContextVar("dualrun_router_step", default=None)


class RouterError(Exception):
    """A request the router cannot answer: the HTTP status to answer with, and why."""

    def __init__(self, status: int, message: str) -> None:
        self.status = status
        super().__init__(message)


class ReplicaError(RouterError):
    """A replica failed a request the router needed: the answer names it. `kind`: a failure kind of rotation.py,
    or None when the replica had left the rotation while the request was on it; `detail`: what happened, for the
    rotation's log line."""

    def __init__(self, index: int, replica: Replica, status: int, text: str, kind: str | None = rotation.STATUS,
                 detail: str | None = None) -> None:
        self.index, self.kind = index, kind
        self.detail = detail or f"answered {status}: {text[:500]}"
        super().__init__(status if status >= 400 else 502, f"replica {index} ({replica.address}) {self.detail}")


class Router:
    """The aiohttp app: one handler that looks the request up in `routing.ROUTES` and treats it accordingly."""

    def __init__(self, replicas: Sequence[str], request_timeout_s: float | None = None,
                 probe_interval_s: float = PROBE_INTERVAL_S, api_key: str | None = None) -> None:
        self.table = rotation.Rotation(replicas)
        self.replicas = self.table.replicas   # the slots (a replacement changes a slot in place)
        self.request_timeout_s = request_timeout_s
        self.probe_interval_s = probe_interval_s
        self._abort: list[set[asyncio.Task]] = [set() for _ in self.replicas]  # the tasks awaiting it, to abort
        self._aborted: set[asyncio.Task] = set()   # cancelled by an abort: retried on another replica
        self._probes: list[asyncio.Task] = []
        self.token = job_token.job_token()   # the job's secret: guard.job_only endpoints require it
        self.api_key = api_key               # the role's --api-key: its inference endpoints require it
        self.headers = job_token.auth_headers(self.token, api_key)   # what its own calls to the replicas carry
        self.upstream = upstream.Upstream(self.headers)   # kept-alive connections to the replicas

    # -- lifecycle --------------------------------------------------------------------------------------
    async def _open(self, _: object = None) -> None:
        if self.probe_interval_s > 0:
            self._probes = [asyncio.ensure_future(self._probe_loop(i)) for i in range(len(self.replicas))]

    async def _close(self, _: object = None) -> None:
        for task in self._probes:
            task.cancel()
        await asyncio.gather(*self._probes, return_exceptions=True)
        self.upstream.close()
        # the last line of its log: how the work was spread (the launcher stops the router with the servers)
        print(f"dualrun router: served per replica: {[r.served for r in self.replicas]}", file=sys.stderr, flush=True)

    # -- talking to replicas ------------------------------------------------------------------------------
    async def call(self, index: int, method: str, path_qs: str, body: bytes | None = None,
                   content_type: str | None = None) -> tuple[int, bytes, str]:
        """(status, body, content type) of one call to replica `index`, with the job's headers (upstream.py)."""
        replica = self.replicas[index]
        replica.requests += 1
        if routing.route(method, path_qs) not in (routing.HEALTH, routing.WORLD_SIZE, routing.FIRST):
            replica.served += 1
        replica.in_flight += 1
        try:
            answer = await self.upstream.request(replica.address, method, path_qs, body, content_type,
                                                 self.request_timeout_s)
            if answer[0] >= 400:
                replica.errors += 1
            return answer
        except asyncio.TimeoutError:  # (before OSError: TimeoutError is one) accepted, no answer: hung
            replica.errors += 1
            raise ReplicaError(index, replica, 504, "", rotation.TIMEOUT,
                               f"gave no answer within {self.request_timeout_s:g} s (request_timeout_s)") from None
        except OSError as e:  # the replica is unreachable, or broke its answer off: a 502
            replica.errors += 1
            raise ReplicaError(index, replica, 502, "", rotation.UNREACHABLE,
                               f"is unreachable: {type(e).__name__}: {e}") from None
        finally:
            replica.in_flight -= 1

    async def call_json(self, index: int, method: str, path_qs: str, payload: Any = None) -> Any:
        body = None if payload is None else json.dumps(payload).encode()
        status, data, _ = await self.call(index, method, path_qs, body, JSON)
        if status != 200:
            raise ReplicaError(index, self.replicas[index], status, data.decode(errors="replace"))
        return json.loads(data or b"null")

    # -- the rotation: requests that go to one replica, retried on another when it fails ---------------------------
    async def forward(self, method: str, path_qs: str, body: bytes | None, content_type: str | None = None,
                      prefer: int | None = None) -> tuple[int, bytes, str]:
        """One replica's answer: `prefer`'s (when in rotation) or the least busy one's; a replica that fails leaves
        the rotation and the request goes to the next, until none is left (the error names every failure). A 4xx
        is the request's fault and goes back as it is; so does a 5xx repeated by a second replica."""
        failures: list[ReplicaError] = []
        tried: set[int] = set()
        index = self.table.pick(prefer=prefer)
        while index is not None:
            tried.add(index)
            incarnation = self.replicas[index].incarnation   # a failure of this engine spares its replacement
            try:
                status, data, answer_type = await self.attempt(index, method, path_qs, body, content_type)
            except ReplicaError as e:
                failures.append(e)
                self._failed(index, e, incarnation)
            else:
                if status < 500 or any(f.kind == rotation.STATUS for f in failures):
                    if status == 200 and routing.route(method, path_qs) in SERVES:   # generation, scoring
                        self.table.served(index, _STEP.get())
                    return status, data, answer_type
                error = ReplicaError(index, self.replicas[index], status, data.decode(errors="replace"))
                if not self._failed(index, error, incarnation):   # kept, the last in rotation: as one engine
                    return status, data, answer_type
                failures.append(error)
            index = self.table.pick(exclude=tried)
        untried = self.table.unavailable(exclude=tried)
        raise RouterError(502 if failures else 503, "no replica could answer: "
                          + "; ".join([str(f) for f in failures] + ([untried] if untried else [])))

    async def attempt(self, index: int, method: str, path_qs: str, body: bytes | None,
                      content_type: str | None) -> tuple[int, bytes, str]:
        """`call`, ended early (ReplicaError, kind None) when the replica leaves the rotation meanwhile for a reason
        that means no answer will come: the abort cancels the task awaiting it (the handler's, or a split part's),
        which is only ever in `flying` while it awaits the call here; no task of its own per request."""
        replica, flying = self.replicas[index], self._abort[index]
        task = asyncio.current_task()
        assert task is not None
        flying.add(task)
        try:
            return await self.call(index, method, path_qs, body, content_type)
        except asyncio.CancelledError:
            if task not in self._aborted:
                raise   # the handler itself was cancelled (the client went away, the router stops)
            if hasattr(task, "uncancel"):   # (3.11+: the abort's cancel is handled here, none left pending)
                task.uncancel()
            raise ReplicaError(index, replica, 502, "", None,
                               f"left the rotation while this request was on it ({replica.reason})") from None
        finally:
            flying.discard(task)
            self._aborted.discard(task)

    def _failed(self, index: int, error: ReplicaError, incarnation: int) -> bool:
        """Tell the table; True when the replica is out of rotation now (it may have been already)."""
        if error.kind is not None:
            self._apply(self.table.fail(index, error.kind, error.detail, time.monotonic(), incarnation))
        return not self.replicas[index].in_rotation

    def _apply(self, event: rotation.Event | None) -> None:
        """Log a change of rotation; abort the requests in flight on the replica when it says so."""
        if event is None:
            return
        print(f"dualrun router: {event.line}", file=sys.stderr, flush=True)
        if event.abort:
            flying, self._abort[event.index] = self._abort[event.index], set()
            for request in flying:   # (they end on the loop's next turns, their in_flight counts with them)
                self._aborted.add(request)
                request.cancel()

    async def _probe_loop(self, index: int) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            replica = self.replicas[index]
            if replica.spare:
                continue
            incarnation, ok, detail = replica.incarnation, False, ""
            try:
                status, _, _ = await self.upstream.request(replica.address, "GET", "/health", None, None,
                                                           PROBE_TIMEOUT_S)
                ok, detail = status == 200, f"health probe answered {status}"
            except asyncio.TimeoutError:
                detail = f"health probe not answered within {PROBE_TIMEOUT_S:g} s"
            except Exception as e:  # noqa: BLE001 - whatever keeps a probe from passing fails it
                detail = f"health probe: {type(e).__name__}: {e}"
            self._apply(self.table.probed(index, ok, detail, time.monotonic(), incarnation))

    def control(self, index: int, action: str, payload: dict) -> web.Response:
        """The launcher's say: replace a replica by a new engine (held out of rotation until restored, when asked),
        restore one, remove one."""
        if index >= len(self.replicas):
            raise ValueError(f"no replica {index}: this router has {len(self.replicas)}")
        now, old = time.monotonic(), self.replicas[index].address
        if action == "replace":
            address = payload.get("address")
            if not isinstance(address, str) or not host_port(address):
                raise ValueError(f"replace needs {{'address': 'host:port'}}, got {payload.get('address')!r}")
            event = self.table.replace(index, address, now, hold=bool(payload.get("hold")))
        elif action == "remove":
            event = self.table.remove(index, str(payload.get("reason") or "removed by the launcher"), now)
        elif action == "retire":
            event = self.table.retire(index, str(payload.get("reason") or "retired by the launcher"), now)
        else:
            event = self.table.restore(index, now)
        if action != "restore":   # (its engine gone or going: its idle connections with it)
            self.upstream.forget(old)
        self._apply(event)
        return web.json_response({"replica": self.table.rows()[index], "membership": self.table.membership})

    async def forward_json(self, path_qs: str, payload: Any, prefer: int) -> Any:
        status, data, _ = await self.forward("POST", path_qs, json.dumps(payload).encode(), JSON, prefer)
        if status != 200:
            raise RouterError(status, f"a replica answered {status}: {data.decode(errors='replace')[:500]}")
        return json.loads(data or b"null")

    async def world_sizes(self, members: Sequence[int]) -> list[int]:
        answers = await asyncio.gather(*(self.call_json(i, "GET", "/get_world_size") for i in members))
        return [int(a["world_size"]) for a in answers]

    # -- the handler ----------------------------------------------------------------------------------------
    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        path = request.path
        if request.method == "GET" and path.rstrip("/") == routing.STATS_PATH:
            return web.json_response({"replicas": self.table.rows(), "in_rotation": self.table.in_rotation(),
                                      "membership": self.table.membership, "step": self.table.step})
        if request.method == "GET" and path.rstrip("/") == protocol.ROUTER_MEMBERSHIP_PATH:
            return web.json_response({"membership": self.table.membership, "members": self.table.members(),
                                      "group": self.table.in_group()})
        refused = guard.refusal(request.method, path, request.headers, self.token, self.api_key)
        if refused is not None:
            return _error(*refused)
        try:
            control = routing.control(request.method, path)
            if control is not None:
                return self.control(*control, _json(await request.read()))
        except ValueError as e:
            return _error(400, str(e))
        treatment = routing.route(request.method, path)
        if treatment is None:
            return _error(404, routing.unknown_endpoint(request.method, path))
        step = routing.step_of(request.headers.get(protocol.STEP_HEADER))
        self.table.heard(step)
        _STEP.set(step)   # (the handler's own task: its split parts copy it)
        body = await request.read()
        try:
            if treatment == routing.HEALTH:
                return self.health()
            if treatment == routing.WORLD_SIZE:   # the engines of the group the next init forms (rotation.counted)
                return web.json_response({"world_size": sum(await self.world_sizes(self.table.counted()))})
            if treatment == routing.FIRST:
                first = next(iter(self.table.in_rotation()), None)
                return _passthrough(*await self.forward(request.method, request.path_qs, body or None, prefer=first))
            if treatment == routing.SPLIT:
                return await self.completions(request, body)
            if treatment == routing.ONE:
                return _passthrough(*await self.forward(request.method, request.path_qs, body,
                                                        _content_type(request)))
            if treatment == routing.INIT_WEIGHTS:   # those the world size counted: the group once all answered
                members = self.table.forming()
                bodies = routing.init_bodies(_json(body), await self.world_sizes(members))
                answer = await self.to_all(request.path_qs, members, [json.dumps(b).encode() for b in bodies])
                if answer.status == 200:
                    self.table.formed(members)
                return answer
            members = self.table.in_group() if treatment == routing.GROUP else self.table.members()   # (taken once)
            return await self.to_all(request.path_qs, members, [body] * len(members), step)
        except RouterError as e:
            return _error(e.status, str(e))
        except ValueError as e:
            return _error(400, str(e))

    def health(self) -> web.Response:
        """Healthy while a replica is in rotation (the probes keep the table current); the others are listed."""
        problems = [f"replica {i} ({r.address}) out of rotation: {r.reason}" for i, r in enumerate(self.replicas)
                    if not r.in_rotation]
        if not self.table.in_rotation():
            return web.json_response({"status": "unhealthy", "problems": problems}, status=503)
        return web.json_response({"status": "ok", "replicas": len(self.replicas),
                                  "in_rotation": len(self.table.in_rotation()), "problems": problems})

    async def completions(self, request: web.BaseRequest, body: bytes) -> web.Response:
        payload = _json(body)
        prompts = routing.prompts_of(payload)
        usable = [] if prompts is None or len(prompts) == 1 else self.table.in_rotation()
        if len(usable) <= 1 or payload.get("stream"):
            return _passthrough(*await self.forward("POST", request.path_qs, body, _content_type(request)))
        parts = routing.split_completion(payload, prompts, len(usable))
        first = usable.index(self.table.pick())
        targets = [usable[(first + i) % len(usable)] for i in range(len(parts))]
        answers = await asyncio.gather(*(self.forward_json(request.path_qs, part, t)
                                         for t, (_, part) in zip(targets, parts)))
        merged = routing.merge_completions([(start, a) for (start, _), a in zip(parts, answers)],
                                           int(payload.get("n") or 1))
        return web.json_response(merged, dumps=_dumps)

    async def to_all(self, path_qs: str, members: Sequence[int], bodies: list[bytes],
                     step: int | None = None) -> web.Response:
        """Every weight-transfer member at once (a collective blocks until all members join); all must answer 200.
        A member that received (of the trainer's `step`) and finished an update is told to the table (a held one is
        restored)."""
        if not members:
            return _error(503, "no replica is in the weight-transfer group: " + self.table.unavailable())
        results = await asyncio.gather(*(self.call(i, "POST", path_qs, b or None, JSON)
                                         for i, b in zip(members, bodies)), return_exceptions=True)
        problems = []
        for i, result in zip(members, results):
            if isinstance(result, BaseException):
                problems.append(str(result))
            elif result[0] != 200:
                problems.append(str(ReplicaError(i, self.replicas[i], result[0], result[1].decode(errors="replace"))))
            else:
                self._weights_step(i, path_qs, step)
        if problems:
            return _error(502, "; ".join(problems))
        return _passthrough(*results[0])  # type: ignore[misc]

    def _weights_step(self, index: int, path_qs: str, step: int | None = None) -> None:
        """A weight-transfer call the replica answered 200: an update it received (the trainer's `step`), or one it
        finished."""
        path = path_qs.split("?")[0].rstrip("/")
        if path == routing.UPDATE_WEIGHTS_PATH:
            self.table.weights_received(index, step)
        elif path == routing.FINISH_UPDATE_PATH:
            self._apply(self.table.weights_finished(index, time.monotonic()))


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


def _content_type(request: web.BaseRequest) -> str:
    return request.headers.get("Content-Type", JSON)


def _passthrough(status: int, data: bytes, content_type: str) -> web.Response:
    return web.Response(status=status, body=data, content_type=content_type or "application/json")


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="dualrun.programs.router", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--replica", action="append", default=[],
                        help=f"host:port of a replica (repeat); {rotation.SPARE!r}: a spare slot with no engine yet")
    parser.add_argument("--request-timeout-s", type=float, default=None,
                        help="a replica that has not answered a request by then is hung: out of rotation, the "
                             "request retried on another (default: none)")
    parser.add_argument("--probe-interval-s", type=float, default=PROBE_INTERVAL_S,
                        help="seconds between health probes of each replica (0: none)")
    parser.add_argument("--api-key", default=None,
                        help="required on the inference endpoints (Authorization: Bearer KEY), as vLLM's; passed on "
                             "to the replicas")
    args = parser.parse_args(argv)
    if not any(r != rotation.SPARE for r in args.replica):
        parser.error("at least one --replica host:port")
    router = Router(args.replica, args.request_timeout_s, args.probe_interval_s, args.api_key)
    quiet_client_trouble(Noise("dualrun router", debug=os.environ.get(protocol.DEBUG) == "1"))
    print(f"dualrun router: serving http://{args.host}:{args.port} for {len(args.replica)} replicas: "
          f"{' '.join(args.replica)}", file=sys.stderr, flush=True)
    one_handler.run(one_handler.serve(router.handle, args.host, args.port, start=router._open, stop=router._close,
                                      client_max_size=1024 ** 3, backlog=1024))   # a connection per request in flight


if __name__ == "__main__":
    main()
