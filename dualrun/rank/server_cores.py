"""While servers on its machine start beside it, a rank leaves them cores; it takes them back once they answer.

Why: side by side, the first step waits for the slower half, and on a machine with few cores both halves compete
for them: a vLLM engine starts as a chain of three processes (API server, engine core, worker), one after the
other, about one core's work, while the ranks' imports, model and dataset take every core they get. On 2 cores the
two ranks slowed the engine's start by 3-4 s, which then held the first step (GRPO: launch to first step 30.2 s with
the whole machine, 26.6 s leaving the server one core, same run: benchmarks/results/startup_side_by_side.md). So
each rank runs on the machine's cores but one per server starting on its machine (the first ones: where vLLM's CPU
build binds its worker), and a thread gives every thread of the rank all its cores back once those servers answer
their health check, or at the wait's bound (`DUALRUN_SERVERS_STARTING`'s `wait_s`). On a machine with many cores
(a GPU node) it costs the ranks a core or two of many, for the start alone.

Only where `OMP_NUM_THREADS` is set (dualrun sets it to 1 when a machine runs several ranks, as torchrun does; else
the user's): a thread pool that sizes itself from the cores it may use (OpenMP, so torch's) would otherwise keep
the narrowed count for good. Not where the rank may use fewer than 2 cores, nor off Linux. Processes the rank
starts meanwhile (a `datasets.map(num_proc=...)`) keep the narrowed set; threads it starts get the whole again.
Output: nothing (a rank's console is the user's).
"""
from __future__ import annotations

import os
import socket
import threading
import time
from typing import Callable, Collection, Mapping, Sequence

from dualrun.contract.protocol import SERVERS_STARTING
from dualrun.rank.server_wait import Starting

POLL_S = 0.1   # between two health checks of a server still starting


def cores_kept(allowed: Collection[int], servers_here: int) -> set[int]:
    """Pure: the cores a rank keeps while `servers_here` servers of its machine start: all but the first one per
    server, at least one; all of them when there is no server here or one core only."""
    ordered = sorted(allowed)
    if servers_here <= 0 or len(ordered) < 2:
        return set(ordered)
    return set(ordered[min(servers_here, len(ordered) - 1):])


def is_local(host: str) -> bool:
    """Whether `host` is an address of this machine: it can be bound here (nothing is sent)."""
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_DGRAM)
    except OSError:
        return False
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.bind(address)
                return True
        except OSError:
            continue
    return False


def servers_here(raw: str | None, local: Callable[[str], bool] = is_local) -> tuple[list[tuple[str, int, str]], float]:
    """From `DUALRUN_SERVERS_STARTING` (read as dualrun/rank/server_wait.py reads it): the (host, port, health path)
    of each server starting on this machine, and the seconds the ranks may wait for them."""
    starting = Starting.from_env({SERVERS_STARTING: raw or ""})
    if starting is None:
        return [], 0.0
    out = []
    for address in starting.servers:
        host, _, port = address.rpartition(":")
        if host and port.isdigit() and local(host.strip("[]")):
            out.append((host.strip("[]"), int(port), starting.health.get(address, "/health")))
    return out, starting.wait_s


def answers(host: str, port: int, path: str, timeout: float = 1.0) -> bool:
    """A health check on a plain socket (a rank's `create_connection` waits for servers still starting:
    dualrun/rank/server_wait.py): status 200 or not."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.settimeout(timeout)
            s.connect((host, port))
            s.sendall(f"GET {path} HTTP/1.0\r\nHost: {host}:{port}\r\n\r\n".encode())
            head = s.recv(64).decode("latin-1")
    except OSError:
        return False
    parts = head.split(" ", 2)
    return len(parts) > 1 and parts[1] == "200"


def give_back(cores: set[int], tasks: Callable[[], Sequence[int]] = lambda: [int(t) for t in
                                                                                   os.listdir("/proc/self/task")]) -> None:
    """Every thread of this process on `cores` again (twice: a thread started during the first pass)."""
    for _ in range(2):
        for tid in tasks():
            try:
                os.sched_setaffinity(tid, cores)
            except OSError:
                pass   # a thread that ended meanwhile


def activate(environ: Mapping[str, str] | None = None, clock: Callable[[], float] = time.monotonic) -> bool:
    """In a rank: narrow its cores while its machine's servers start and start the thread that gives them back;
    whether it did."""
    env = os.environ if environ is None else environ
    if "OMP_NUM_THREADS" not in env or not hasattr(os, "sched_setaffinity"):
        return False
    try:
        here, wait_s = servers_here(env.get(SERVERS_STARTING))
        allowed = os.sched_getaffinity(0)
    except (ValueError, OSError):
        return False
    kept = cores_kept(allowed, len(here))
    if kept == set(allowed):
        return False
    os.sched_setaffinity(0, kept)
    deadline = clock() + wait_s

    def watch() -> None:
        waiting = list(here)
        while waiting and clock() < deadline:
            waiting = [s for s in waiting if not answers(*s)]
            if waiting:
                time.sleep(POLL_S)
        give_back(set(allowed))

    threading.Thread(target=watch, name="dualrun-server-cores", daemon=True).start()
    return True
