"""The job's secret on a vLLM server dualrun starts: an HTTP middleware vLLM loads (`--middleware
dualrun.programs.vllm_guard.job_guard`).

Why: a rollout server runs in dev mode (TRL's weight transfer needs it), which opens `/pause`, `/sleep`,
`/collective_rpc`, `/init_weight_transfer_engine`, `/update_weights`, ...; vLLM's own `--api-key` guards only its
inference paths (`/v1`, `/v2`, `/inference`, `/cohere`). Every other path but the health checks then needs the
job's secret (contract/job_token.py), which dualrun's own clients carry (the router, the trainers' TRL clients
through dualrun/rank/server_auth.py). A server with no secret in its env (started by hand) is not guarded.
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable

from dualrun.contract.job_token import job_token
from dualrun.programs import guard

OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})   # what anyone may ask


def job_only(method: str, path: str) -> bool:
    """Pure: everything but the inference paths (the user's `--api-key`'s, vLLM's) and the health checks."""
    path = path.split("?")[0].rstrip("/") or "/"
    return not guard.needs_api_key(path) and path not in OPEN_PATHS


async def job_guard(request: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
    """FastAPI/Starlette HTTP middleware: 401/403 for a request to a job-only path without the job's secret."""
    refused = guard.refusal(request.method, request.url.path, request.headers, _TOKEN, None, job_only)
    if refused is None:
        return await call_next(request)
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": refused[1]}}, status_code=refused[0])


_TOKEN = job_token()

