"""What a trainer's requests to the job's servers carry: the job's secret, and the role's `--api-key` when it has
one, added to TRL's clients without changing them.

Why by URL: TRL's clients (GRPOTrainer's `VLLMClient`, AsyncGRPOTrainer's) are built by the trainer from an address
dualrun wired in; a request whose `host:port` is a separate role's (`DUALRUN_<ROLE>_ADDRESS`) gets the job's secret
(contract/job_token.py, its own header) and, when the role's `server_args` give `--api-key`, `Authorization: Bearer
KEY` (`DUALRUN_<ROLE>_API_KEY`, as vLLM reads it). Requests to anything else carry neither. AsyncGRPOTrainer's
rollout child generates on an aiohttp session in a spawned process: its requests carry them too.

Once a trainer trains, a request also carries the trainer's global step (`protocol.STEP_HEADER`): a role's router
tells from it from which step a replica that joins serves (the step of its first weight update, or of the first
request it answered). A header and not a field of the body: TRL's clients and their bodies stay unchanged,
it reaches the router on every call whichever TRL method posts it (NCCL or gloo weight sync, generation, scoring),
and the router forwards no trainer header to the engines, so they never see it.
"""
from __future__ import annotations

import os
import types
from typing import Any, Mapping
from urllib.parse import urlsplit

from dualrun.contract import job_token, protocol

_INSTALLED = "_dualrun_server_auth"


def headers_for(url: str, environ: Mapping[str, str] | None = None, step: int | None = None) -> dict[str, str]:
    """Pure: the headers a request to `url` carries (none when it is no server of the job); `step`: the trainer's
    global step, when it trains."""
    environ = os.environ if environ is None else environ
    netloc = urlsplit(url).netloc
    for name, value in environ.items():
        role = protocol.address_role(name) if value == netloc else None
        if role is not None:
            return {**job_token.auth_headers(job_token.job_token(environ), environ.get(protocol.api_key_env(role))),
                    **({protocol.STEP_HEADER: str(step)} if step is not None else {})}
    return {}


def session() -> Any:
    """A `requests.Session` whose requests to the job's servers carry their headers."""
    import requests

    class JobSession(requests.Session):
        def request(self, method: str, url: str, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
            from dualrun.rank.rollout_seeds import global_step

            kwargs["headers"] = {**headers_for(url, step=global_step()), **(kwargs.get("headers") or {})}
            return super().request(method, url, *args, **kwargs)

    return JobSession()


def _requests_with_headers() -> types.ModuleType:
    """`requests` as a module whose `Session`, `get`, `post` and `request` add the job's headers."""
    import requests

    shim = types.ModuleType("requests")
    shim.__dict__.update({k: v for k, v in vars(requests).items() if not k.startswith("__")})
    shim.Session = lambda: session()   # type: ignore[attr-defined]
    shim.request = lambda method, url, **kw: session().request(method, url, **kw)   # type: ignore[attr-defined]
    shim.get = lambda url, **kw: session().request("GET", url, **kw)   # type: ignore[attr-defined]
    shim.post = lambda url, **kw: session().request("POST", url, **kw)   # type: ignore[attr-defined]
    return shim


def _aiohttp_with_headers() -> types.ModuleType:
    """`aiohttp` as a module whose `ClientSession` adds the job's headers to each request (aiohttp's own client
    middleware: the URL is known per request)."""
    import aiohttp

    async def job_headers(request: Any, handler: Any) -> Any:
        for name, value in headers_for(str(request.url)).items():
            request.headers.setdefault(name, value)
        return await handler(request)

    def client_session(*args: Any, **kwargs: Any) -> Any:
        kwargs["middlewares"] = (*(kwargs.get("middlewares") or ()), job_headers)
        return aiohttp.ClientSession(*args, **kwargs)

    shim = types.ModuleType("aiohttp")
    shim.__dict__.update({k: v for k, v in vars(aiohttp).items() if not k.startswith("__")})
    shim.ClientSession = client_session   # type: ignore[attr-defined]
    return shim


def async_rollout_child(*args: Any, **kwargs: Any) -> Any:
    """AsyncGRPOTrainer's rollout child, which generates on its own aiohttp session: TRL spawns it (`spawn`: none of
    the parent's hooks), so this runs first in the child, puts the headers on that session, then runs TRL's own
    `_child_main`."""
    from trl.experimental.async_grpo import async_rollout_worker as worker

    worker.aiohttp = _aiohttp_with_headers()
    return getattr(worker, _ORIGINAL_CHILD, worker._child_main)(*args, **kwargs)


_ORIGINAL_CHILD = "_dualrun_child_main"


def install_rollout_worker(module: Any) -> None:
    """TRL's async rollout worker module: the child it spawns (`target=_child_main`) starts with the headers."""
    if getattr(module, _ORIGINAL_CHILD, None) is not None or not hasattr(module, "_child_main"):
        return
    setattr(module, _ORIGINAL_CHILD, module._child_main)
    module._child_main = async_rollout_child


def install(module: Any) -> None:
    """`module` (a TRL client module) talks to the job's servers with their headers."""
    if getattr(module, _INSTALLED, False) or not hasattr(module, "requests"):
        return
    module.requests = _requests_with_headers()
    setattr(module, _INSTALLED, True)


def activate() -> None:
    """In every trainer rank of a job with separate roles: TRL's clients carry the job's headers."""
    from dualrun.rank.hooks import when_imported

    if any(protocol.address_role(name) for name in os.environ):
        from dualrun.rank.rollout_seeds import follow_training

        when_imported("transformers.trainer_callback", follow_training)   # the trainer's step, for the step header
        when_imported("trl.generation.vllm_client", install)
        when_imported("trl.experimental.async_grpo.vllm_client", install)
        when_imported("trl.experimental.async_grpo.async_rollout_worker", install_rollout_worker)
