"""One member of `dualrun check`'s weight-sync rehearsal: `python -m dualrun.weightsync.probe '<spec JSON>'`.

Joins the group the way the job's weight sync does (`wire.tcp_store` + `wire.group_store`: a TCPStore whose master
is rank 0, the trainer, at `address:port`, the group's prefix, one torch.distributed backend object per rank, no
global `init_process_group`; NCCL where the engines have GPUs, as TRL's own group there), broadcasts one small
tensor from rank 0, then moves a payload of `payload_bytes` (64 MiB unless the spec says) as the sync moves weights:
on gloo down the group's chain (`dualrun.weightsync.stream`, the job's own code), on NCCL as one broadcast (vLLM's
NCCL engine broadcasts its packed chunks). A member holding several ranks (an engine replica's workers) runs each
in a thread. Prints one JSON line: `ok`, `backend`, the `seconds` from the first connect to the small tensor's
arrival, the payload's bytes, the seconds from the start line to its last byte here (`payload_s`, the slowest of
the member's ranks) and, but on the trainer's, the `link` of the member's node toward the trainer (`links.py`);
or `error` (one line) and whether it was a `timeout`.
"""
from __future__ import annotations

import json
import re
import sys
import threading
import time
from datetime import timedelta
from typing import Any

from dualrun.weightsync.links import link_toward

_BACKEND_KEY = "dualrun/weight-sync-backend"
_ARRIVED_KEY = "dualrun/weight-sync-arrived"
START_S = 85.0   # from this process's start to every member's: a fresh interpreter importing torch on a busy node
_BORN = time.monotonic()
PAYLOAD_BYTES = 64 * 1024 * 1024   # enough to time a link of up to tens of Gbit/s; a second at ~500 Mbit/s


def backend_for(gpus: bool) -> str:
    """The master's choice, read by every member from the store: NCCL where the engines have GPUs and the
    trainer's node has CUDA (TRL's trainer decides from its device), gloo otherwise."""
    import torch

    return "nccl" if gpus and torch.cuda.is_available() else "gloo"


def one_line(e: BaseException) -> str:
    """torch's errors span lines and start with the C++ source location: the last line, without it."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[-1]
    return re.sub(r"^\[enforce fail at [^\]]*\]\s*(\S+ != \S+\.\s*)?", "", text).strip() or type(e).__name__


def join(prefixed: Any, rank: int, world_size: int, backend: str, device: int, timeout: timedelta,
         payload_bytes: int = 0) -> tuple[list[float], float]:
    """Rank `rank`'s backend on the group's store (`wire.group_store`), the small broadcast from rank 0 (what
    arrived), then the payload (the seconds from the start line to its last byte here; 0 with no payload)."""
    import torch

    if backend == "nccl":
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = ProcessGroupNCCL(prefixed, rank, world_size, opts)
        tensor = torch.arange(4.0, device=f"cuda:{device}") if rank == 0 else torch.zeros(4, device=f"cuda:{device}")
    else:
        from torch.distributed import ProcessGroupGloo

        pg = ProcessGroupGloo(prefixed, rank, world_size, timeout)
        tensor = torch.arange(4.0) if rank == 0 else torch.zeros(4)
    pg.broadcast([tensor]).wait()
    got = tensor.cpu().tolist()
    if not payload_bytes:
        return got, 0.0
    if backend == "nccl":
        return got, _nccl_payload(pg, rank, device, payload_bytes)
    return got, _gloo_payload(pg, rank, world_size, payload_bytes)


def payload(nbytes: int) -> Any:
    """The payload's bytes: a pattern each receiver can check without a copy of its own."""
    import torch

    return torch.arange(251, dtype=torch.uint8).repeat(nbytes // 251 + 1)[:nbytes]


def check_payload(chunk: Any) -> None:
    import torch

    step = 4099   # a prime: every position of the pattern is sampled
    sample = chunk[::step]
    want = (torch.arange(0, chunk.numel(), step, dtype=torch.int64) % 251).to(torch.uint8)
    if not torch.equal(sample, want):
        raise RuntimeError(f"the payload arrived changed ({int((sample != want).sum())} of {want.numel()} sampled "
                           "bytes differ)")


def _gloo_payload(pg: Any, rank: int, world_size: int, nbytes: int) -> float:
    """The payload down the chain, as the sync streams weights: rank 0's Sender, the others' relaying Receivers."""
    from dualrun.weightsync.stream import Receiver, Sender

    data = payload(nbytes) if rank == 0 else None
    pg.barrier().wait()
    start = time.perf_counter()
    if rank == 0:
        Sender(pg).send([data])
    else:
        Receiver(pg, rank, world_size).receive([[nbytes]], lambda _, chunk: check_payload(chunk))
    return time.perf_counter() - start


def _nccl_payload(pg: Any, rank: int, device: int, nbytes: int) -> float:
    import torch

    data = payload(nbytes).to(f"cuda:{device}") if rank == 0 else torch.empty(nbytes, dtype=torch.uint8,
                                                                              device=f"cuda:{device}")
    pg.broadcast([torch.zeros(1, device=f"cuda:{device}")]).wait()   # the start line
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    pg.broadcast([data]).wait()
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    if rank:
        check_payload(data.cpu())
    return seconds


def meet(store: Any, mine: int, world_size: int, within_s: float) -> None:
    """Every member's process up before the group's clock starts: the members start on different nodes at
    different times (a Ray task's worker, `import torch` on a loaded machine: tens of seconds apart), and the
    group's bound is for forming the group, not for the slowest start."""
    here = store.add(_ARRIVED_KEY, mine)
    deadline = time.monotonic() + within_s
    while here < world_size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{here} of {world_size} ranks had started within {within_s:.0f} s")
        time.sleep(0.05)
        here = store.add(_ARRIVED_KEY, 0)


def probe(spec: dict[str, Any]) -> dict[str, Any]:
    from dualrun.weightsync.wire import group_store, tcp_store

    import torch.distributed  # noqa: F401 - imported before the clock starts: on a busy node it takes seconds

    timeout_s = float(spec["timeout_s"])
    timeout = timedelta(seconds=timeout_s)
    ranks, world = [int(r) for r in spec["ranks"]], int(spec["world_size"])
    master = 0 in ranks
    start = time.monotonic()
    backend = None
    try:
        address, port = spec["address"], int(spec["port"])
        meet_s = max(1.0, _BORN + float(spec.get("start_s", START_S)) - start)
        store = tcp_store(address, port, 0 if master else 1, world, timedelta(seconds=meet_s))
        meet(store, len(ranks), world, meet_s)
        store.set_timeout(timeout)
        start = time.monotonic()   # the handshake is timed from here: every member's process is up
        if master:
            backend = backend_for(bool(spec["gpus"]))
            store.set(_BACKEND_KEY, backend)
        else:
            backend = store.get(_BACKEND_KEY).decode()
        got: dict[int, Any] = {}
        nbytes = int(spec.get("payload_bytes", PAYLOAD_BYTES))

        def run(rank: int, device: int) -> None:
            try:   # a store client per rank: one client's blocking wait would hold up the others' requests
                own = store if device == 0 else tcp_store(address, port, 1, world, timeout)
                got[rank] = join(group_store(own, address, port), rank, world, backend, device, timeout, nbytes)
            except BaseException as e:  # noqa: BLE001 - reported as the member's one line
                got[rank] = e

        threads = [threading.Thread(target=run, args=(r, i), daemon=True) for i, r in enumerate(ranks)]
        for t in threads:
            t.start()
        deadline = start + timeout_s + 5.0
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        payload_s = 0.0
        for r in ranks:
            value = got.get(r, TimeoutError(f"rank {r} did not finish within {timeout_s:g} s"))
            if isinstance(value, BaseException):
                raise value
            arrived, seconds = value
            if arrived != [0.0, 1.0, 2.0, 3.0]:
                raise RuntimeError(f"rank {r} received {arrived}, rank 0 sent [0.0, 1.0, 2.0, 3.0]")
            payload_s = max(payload_s, seconds)
    except Exception as e:  # noqa: BLE001 - one line for the check, whatever torch raised
        spent = time.monotonic() - start
        return {"ok": False, "backend": backend, "timeout": isinstance(e, TimeoutError) or spent >= 0.9 * timeout_s,
                "error": f"{one_line(e)} (after {spent:.1f} s)"}
    handshake_s = time.monotonic() - start - payload_s
    return {"ok": True, "backend": backend, "seconds": handshake_s, "payload_bytes": nbytes, "payload_s": payload_s,
            "link": None if master else link_toward(address, spec["env"])}


def main(argv: list[str]) -> int:
    result = probe(json.loads(argv[1]))
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
