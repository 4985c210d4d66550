"""What a trainer's requests to the job's servers carry: the job's secret, and the role's `--api-key` when it has
one, added to TRL's clients without changing them.

Why by URL: TRL's clients (GRPOTrainer's `VLLMClient`, AsyncGRPOTrainer's) are built by the trainer from an address
dualrun wired in; a request whose `host:port` is a separate role's (`DUALRUN_<ROLE>_ADDRESS`) gets the job's secret
(contract/job_token.py, its own header) and, when the role's `server_args` give `--api-key`, `Authorization: Bearer
KEY` (`DUALRUN_<ROLE>_API_KEY`, as vLLM reads it). Requests to anything else carry neither.
"""
from __future__ import annotations

import os
import types
from typing import Any, Mapping
from urllib.parse import urlsplit

from dualrun.contract import job_token, protocol

_INSTALLED = "_dualrun_server_auth"


def headers_for(url: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Pure: the headers a request to `url` carries (none when it is no server of the job)."""
    environ = os.environ if environ is None else environ
    netloc = urlsplit(url).netloc
    for name, value in environ.items():
        role = protocol.address_role(name) if value == netloc else None
        if role is not None:
            return job_token.auth_headers(job_token.job_token(environ), environ.get(protocol.api_key_env(role)))
    return {}


def session() -> Any:
    """A `requests.Session` whose requests to the job's servers carry their headers."""
    import requests

    class JobSession(requests.Session):
        def request(self, method: str, url: str, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
            kwargs["headers"] = {**headers_for(url), **(kwargs.get("headers") or {})}
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
        when_imported("trl.generation.vllm_client", install)
        when_imported("trl.experimental.async_grpo.vllm_client", install)
