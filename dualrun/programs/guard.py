"""Who a server of the job answers: pure rules, the same for the router and the CPU engine.

Two keys, two headers. The job's secret (contract/job_token.py, its own header) is required on the requests that
change what the job trains on: the router's control endpoints (point a replica elsewhere, take it out) and the
calls it fans out to every replica (weights, pause), the CPU engine's weight-sync calls, a vLLM server's dev-mode
paths (vllm_guard.py). A user's
`--api-key` (a role's `server_args`) is required on the inference endpoints as `Authorization: Bearer KEY`, on the
paths vLLM's own `--api-key` guards; `/health` and the rest stay open.
"""
from __future__ import annotations

import functools
from typing import Mapping

from dualrun.contract import job_token
from dualrun.programs import routing

# vLLM's `--api-key` guards the paths under these (vllm/entrypoints/openai/api_server.py, AuthenticationMiddleware);
# the CPU engine's older `/generate` is inference too.
API_KEY_PREFIXES = ("/v1", "/v2", "/inference", "/cohere", "/generate")


@functools.lru_cache(maxsize=256)   # pure, and asked on every request to a server that has a key
def needs_api_key(path: str) -> bool:
    """Is `path` an inference endpoint (what a user's `--api-key` guards)?"""
    path = path.split("?")[0]
    return any(path == p or path.startswith(p + "/") for p in API_KEY_PREFIXES)


@functools.lru_cache(maxsize=256)   # pure, and asked on every request to a server that has a secret
def job_only(method: str, path: str) -> bool:
    """Does `method path` change the job (only its own processes may ask it)? The router's control endpoints, and
    the calls it fans out to every replica: weight transfer, pause and resume, adapters, prefix-cache reset."""
    if method.upper() == "POST" and path.split("?")[0].startswith(routing.CONTROL_PATH + "/"):
        return True
    return routing.route(method, path) in (routing.INIT_WEIGHTS, routing.GROUP, routing.ALL)


def refusal(method: str, path: str, headers: Mapping[str, str], token: str | None,
            api_key: str | None, job_paths=job_only) -> tuple[int, str] | None:
    """Pure: None when the request may be served, else (status, why): 401 without the key it needs, 403 with a
    wrong one. `job_paths(method, path)`: the endpoints that need the job's secret (a server's own set)."""
    if token and job_paths(method, path):   # (no secret: nothing to check, the path not even classified)
        status = job_token.refusal(headers.get(job_token.HEADER), token)
        if status is not None:
            return status, f"{method} {path.split('?')[0]} changes the job: only the job's own processes may ask it"
    if api_key and needs_api_key(path):
        status = job_token.api_key_refusal(headers.get("Authorization"), api_key)
        if status is not None:
            return status, "the server's --api-key is required (Authorization: Bearer KEY)"
    return None

