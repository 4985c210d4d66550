"""The launcher's side of the router's rotation: ask a running router to replace, restore or remove a replica.

Why a client of its own: the router runs in another process (a ServerProcess, a Ray actor, or on machine 0 of
several), so the launcher's restart logic talks to it over HTTP, like the trainers; the rules it triggers are
`rotation.py`'s. Standard library only: the launcher has no aiohttp session.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from dualrun.contract.job_token import auth_headers, job_token
from dualrun.programs import routing

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))   # loopback and cluster hosts: no proxy


def control(router: str, index: int, action: str, timeout_s: float = 10.0, **fields: Any) -> dict:
    """POST `{CONTROL_PATH}/<index>/<action>` to the router at `router` (host:port): `replace` with
    `address="host:port"` and `hold=True` to keep a new engine out of rotation until `restore`; `remove` with a
    `reason`. The router's answer: the replica's row and the weight-transfer membership. RuntimeError with the
    router's message when it refuses."""
    if action not in routing.CONTROL_ACTIONS:
        raise ValueError(f"action must be one of {routing.CONTROL_ACTIONS}, got {action!r}")
    request = urllib.request.Request(f"http://{router}{routing.CONTROL_PATH}/{index}/{action}",
                                     data=json.dumps(fields).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **auth_headers(job_token())})
    try:
        with _OPENER.open(request, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        message = json.loads(e.read() or b"{}").get("error", {}).get("message", str(e))
        raise RuntimeError(f"router {router} refused {action} of replica {index}: {message}") from None


def replicas(router: str, timeout_s: float = 10.0) -> dict:
    """The router's table: each replica's address, whether it is in rotation and why not, its counters; the indices
    in rotation; the membership (grows with each replacement)."""
    with _OPENER.open(f"http://{router}{routing.STATS_PATH}", timeout=timeout_s) as resp:
        return json.loads(resp.read())
