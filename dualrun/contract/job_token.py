"""The per-job secret: what lets a job's own processes, and no one else, change what its servers do.

Why: a job's servers listen on a port any local user (and on several machines anyone on the network) can reach;
the launcher makes one random token per job, gives it to every server and trainer in the env
(`protocol.JOB_TOKEN`), and the servers answer the requests that change the job (the router's control endpoints)
only when they carry it in a header of their own (`HEADER`; `Authorization` stays the user's `--api-key`'s, as
vLLM reads it). Standard library only: servers import it.
"""
from __future__ import annotations

import hmac
import os
import secrets
from typing import Mapping

from dualrun.contract.protocol import JOB_TOKEN

HEADER = "X-Dualrun-Job-Token"
UNAUTHORIZED, FORBIDDEN = 401, 403


def new_token() -> str:
    """A fresh job secret (256 random bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def job_token(environ: Mapping[str, str] | None = None) -> str | None:
    """This process's job secret, None when it has none (a server started by hand: nothing is guarded)."""
    value = (os.environ if environ is None else environ).get(JOB_TOKEN, "")
    return value or None


def auth_headers(token: str | None, api_key: str | None = None) -> dict[str, str]:
    """The headers a request to the job's servers carries: the job's secret (none without a token) and, for a
    role whose servers require a user's `--api-key`, `Authorization: Bearer KEY`."""
    return {**({HEADER: token} if token else {}), **({"Authorization": f"Bearer {api_key}"} if api_key else {})}


def bearer(header: str | None) -> str | None:
    """The credential of an `Authorization: Bearer X` header value, None when it is not one."""
    scheme, _, credential = (header or "").strip().partition(" ")
    return (credential.strip() or None) if scheme.lower() == "bearer" else None


def matches(given: str | None, secret: str | None) -> int | None:
    """Pure: None when a request presenting `given` may pass a guard keyed by `secret` (no secret: no guard), else
    the status to answer: 401 without a credential, 403 with a wrong one (compared in constant time)."""
    if not secret:
        return None
    if not given:
        return UNAUTHORIZED
    return None if hmac.compare_digest(given.encode(), secret.encode()) else FORBIDDEN


def refusal(header: str | None, token: str | None) -> int | None:
    """`matches` for the job's secret, given the value of its header."""
    return matches((header or "").strip() or None, token)


def api_key_refusal(authorization: str | None, api_key: str | None) -> int | None:
    """`matches` for a user's `--api-key`, given the `Authorization` header (`Bearer KEY`, as vLLM's)."""
    return matches(bearer(authorization), api_key)
