"""`dualrun scale ROLE N`'s side: find the job in this user's registry, ask its control channel, say the answer.

Why apart from the channel: this runs in a short-lived process of its own (the CLI), reads the registry the
launcher wrote (job_registry.py) and speaks to the launcher over loopback HTTP with the job's secret
(job_control.py). The choice of the job is pure (`pick`); the rest is one request. Standard library only.
"""
from __future__ import annotations

import http.client
import json
import sys
import time
from typing import Any, Mapping, TextIO

from dualrun.contract.errors import DualrunError, ScaleRefused, one_line
from dualrun.contract.job_token import HEADER
from dualrun.launchers import job_registry
from dualrun.launchers.job_control import fleets_words
from dualrun.launchers.job_registry import JobRecord

ANSWER_WAIT_S = 900.0   # a grown replica answers once it serves: a model's load, an engine's start
LIST_WAIT_S = 2.0       # each job's live counts for a listing; its registered ones after that
NO_JOB = "no dualrun job with a scalable fleet is running for this user on this machine"


class NoJob(DualrunError):
    """No job, or not one that is named: one line, exit 2 (nothing was asked)."""

    exit_code = 2


class JobGone(DualrunError):
    """The job's channel did not answer as a running job would: exit 1 (nothing is known to have changed)."""


def pick(records: list[JobRecord], wanted: str | None) -> JobRecord:
    """Pure: the job to ask. NoJob when none runs, when `wanted` names none of them, or when several run and none
    is named (the caller lists them first: `listing`)."""
    if not records:
        raise NoJob(NO_JOB)
    if wanted is not None:
        for record in records:
            if record.run_id == wanted:
                return record
        raise NoJob(f"no running job {one_line(wanted, 60)}; running: " + ", ".join(r.run_id for r in records))
    if len(records) > 1:
        raise NoJob(f"{len(records)} dualrun jobs with a scalable fleet are running: name one with --job RUN_ID")
    return records[0]


def describe(record: JobRecord, fleets: Mapping[str, Mapping[str, int]] | None = None) -> str:
    """Pure: one line of a listing: run id, start, config, each role's replicas and bounds (`fleets`: live ones)."""
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.started))
    return (f"  {record.run_id}  started {started}  config {one_line(record.config or '-', 120)}  "
            f"{fleets_words(fleets if fleets is not None else record.roles)}")


def request(record: JobRecord, method: str, path: str, body: dict[str, Any] | None = None,
            timeout: float = ANSWER_WAIT_S) -> tuple[int, dict[str, Any]]:
    """One request to the job's channel with its secret; (status, JSON answer). OSError when it cannot be reached."""
    host, _, port = record.address.rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        payload = json.dumps(body).encode() if body is not None else None
        headers = {HEADER: record.token, **({"Content-Type": "application/json"} if payload is not None else {})}
        conn.request(method, path, body=payload, headers=headers)
        response = conn.getresponse()
        raw = response.read(1 << 20)
        try:
            data = json.loads(raw or b"{}")
        except ValueError:
            data = {}
        return response.status, data if isinstance(data, dict) else {}
    finally:
        conn.close()


def live_fleets(record: JobRecord) -> dict[str, dict[str, int]] | None:
    """The job's fleets now, None when it does not answer in LIST_WAIT_S."""
    try:
        status, data = request(record, "GET", "/fleets", timeout=LIST_WAIT_S)
    except (OSError, ValueError):
        return None
    fleets = data.get("fleets")
    return fleets if status == 200 and isinstance(fleets, dict) else None


def scale(role: str, replicas: int, job: str | None, environ: Mapping[str, str] | None = None,
          out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """The command: pick the job, ask it, print its line; the exit code. NoJob, ScaleRefused or JobGone (one line)
    otherwise; with several jobs and no `job`, their lines come first on `err`."""
    records = job_registry.running_jobs(environ)
    if job is None and len(records) > 1:
        for record in records:
            err.write(describe(record, live_fleets(record)) + "\n")
    record = pick(records, job)
    err.write(f"dualrun: asking job {record.run_id} to resize {one_line(role, 60)} to {replicas} "
              f"(the answer comes once it is done) ...\n")
    err.flush()
    try:
        status, data = request(record, "POST", "/scale", {"role": role, "replicas": replicas})
    except ConnectionRefusedError:
        job_registry.unregister(job_registry.path_of(record, environ))
        raise JobGone(f"job {record.run_id} is gone (its control channel at {record.address} refused the "
                      "connection); nothing was resized") from None
    except TimeoutError:
        raise JobGone(f"job {record.run_id} did not answer within {ANSWER_WAIT_S:.0f} s; the resize may still be "
                      "under way") from None
    except (OSError, http.client.HTTPException) as e:
        raise JobGone(f"job {record.run_id} did not answer: {type(e).__name__}: {e}") from None
    if status == 200 and isinstance(data.get("line"), str):
        out.write(one_line(data["line"], 1000) + "\n")
        return 0
    error = one_line(str(data.get("error") or f"HTTP {status}"), 1000)
    if status in (400, 409):
        raise ScaleRefused(error)
    if status == 410:   # the job ended while the resize was under way (job_control.py)
        raise JobGone(f"job {record.run_id}: {error}")
    raise JobGone(f"job {record.run_id} answered {status}: {error}")
