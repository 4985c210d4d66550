"""Multi-machine torchrun: the waits on machine 0's store before a machine's servers start.

Why apart from machine_servers.py: they run before a machine has a server set (the job's secret, `take_token`) or
between two of them (a restart, `await_attempt`), and need only the store's client.
"""
from __future__ import annotations

import time

from dualrun.contract import job_store, protocol
from dualrun.contract.errors import LaunchError


def await_attempt(host: str, port: int, attempt: int, timeout_s: float = job_store.WAIT_S) -> None:
    """Machine K >= 1, before its restart `attempt`: wait while the store at `host:port` is still the ending
    attempt's (machine 0 restarts too, on the same port, once its agent has stopped), so that neither this machine's
    addresses nor its torchrun agent go to a store about to vanish. Returns once it is gone or marked `attempt`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and job_store.listening(host, port):
        try:
            store = job_store.connect(host, port, 2.0)
            if store.check([job_store.ATTEMPT_KEY]) and int(store.get(job_store.ATTEMPT_KEY)) >= attempt:
                return
        except Exception:  # noqa: BLE001 - the store went away meanwhile: the next look sees it gone
            pass
        time.sleep(0.5)


def take_token(host: str, port: int, machine: int, timeout_s: float) -> str:
    """Machine K >= 1 with no DUALRUN_JOB_TOKEN of its own, before its servers start: the secret machine 0 made, from
    its store at `host:port` (machine 0 puts it there once its agent's store listens: `Machines._exchange`), so the
    servers here refuse whoever lacks it. LaunchError when machine 0 does not hand it over within `timeout_s`, or
    set DUALRUN_JOB_TOKEN itself (that one is not handed out: every machine needs the same)."""
    try:
        value = job_store.connect(host, port, timeout_s).get(job_store.TOKEN_KEY).decode()
    except Exception as e:  # noqa: BLE001 - no store, or no key, within the bound: machine 0 is not there
        raise LaunchError(
            f"machine 0 ({host}) did not hand over the job's secret within {timeout_s:g} s "
            f"(torchrun.rendezvous_timeout_s; its store at {host}:{port}, main_process_ip and main_process_port): it "
            f"is not started, has ended, or this machine cannot reach it ({type(e).__name__})") from None
    if not value:
        raise LaunchError(f"{protocol.JOB_TOKEN}: expected the same value on every machine, got unset on machine "
                          f"{machine} while machine 0 has one (set it on every machine, or on none)", 2)
    return value
