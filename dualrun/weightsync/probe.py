"""One member of `dualrun check`'s weight-sync handshake: `python -m dualrun.weightsync.probe '<spec JSON>'`.

Joins the group the way the job's weight sync does (`wire.tcp_store` + `wire.group_store`: a TCPStore whose master
is rank 0, the trainer, at `address:port`, the group's prefix, one torch.distributed backend object per rank, no
global `init_process_group`; NCCL where the engines have GPUs, as TRL's own group there) - and broadcasts one small tensor from rank 0. A member holding
several ranks (an engine replica's workers) runs each in a thread. Prints one JSON line: `ok`, `backend` and the
`seconds` from the first connect to the tensor's arrival, or `error` (one line) and whether it was a `timeout`.
"""
from __future__ import annotations

import json
import re
import sys
import threading
import time
from datetime import timedelta
from typing import Any

_BACKEND_KEY = "dualrun/weight-sync-backend"


def backend_for(gpus: bool) -> str:
    """The master's choice, read by every member from the store: NCCL where the engines have GPUs and the
    trainer's node has CUDA (TRL's trainer decides from its device), gloo otherwise."""
    import torch

    return "nccl" if gpus and torch.cuda.is_available() else "gloo"


def one_line(e: BaseException) -> str:
    """torch's errors span lines and start with the C++ source location: the last line, without it."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[-1]
    return re.sub(r"^\[enforce fail at [^\]]*\]\s*(\S+ != \S+\.\s*)?", "", text).strip() or type(e).__name__


def join(prefixed: Any, rank: int, world_size: int, backend: str, device: int, timeout: timedelta) -> list[float]:
    """Rank `rank`'s backend on the group's store (`wire.group_store`), and the broadcast from rank 0: what arrived."""
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
    return tensor.cpu().tolist()


def probe(spec: dict[str, Any]) -> dict[str, Any]:
    from dualrun.weightsync.wire import group_store, tcp_store

    timeout_s = float(spec["timeout_s"])
    timeout = timedelta(seconds=timeout_s)
    ranks, world = [int(r) for r in spec["ranks"]], int(spec["world_size"])
    master = 0 in ranks
    start = time.monotonic()
    backend = None
    try:
        address, port = spec["address"], int(spec["port"])
        store = tcp_store(address, port, 0 if master else 1, world, timeout)
        if master:
            backend = backend_for(bool(spec["gpus"]))
            store.set(_BACKEND_KEY, backend)
        else:
            backend = store.get(_BACKEND_KEY).decode()
        got: dict[int, Any] = {}

        def run(rank: int, device: int) -> None:
            try:   # a store client per rank: one client's blocking wait would hold up the others' requests
                own = store if device == 0 else tcp_store(address, port, 1, world, timeout)
                got[rank] = join(group_store(own, address, port), rank, world, backend, device, timeout)
            except BaseException as e:  # noqa: BLE001 - reported as the member's one line
                got[rank] = e

        threads = [threading.Thread(target=run, args=(r, i), daemon=True) for i, r in enumerate(ranks)]
        for t in threads:
            t.start()
        deadline = start + timeout_s + 5.0
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        for r in ranks:
            value = got.get(r, TimeoutError(f"rank {r} did not finish within {timeout_s:g} s"))
            if isinstance(value, BaseException):
                raise value
            if value != [0.0, 1.0, 2.0, 3.0]:
                raise RuntimeError(f"rank {r} received {value}, rank 0 sent [0.0, 1.0, 2.0, 3.0]")
    except Exception as e:  # noqa: BLE001 - one line for the check, whatever torch raised
        spent = time.monotonic() - start
        return {"ok": False, "backend": backend, "timeout": spent >= 0.9 * timeout_s,
                "error": f"{one_line(e)} (after {spent:.1f} s)"}
    return {"ok": True, "backend": backend, "seconds": time.monotonic() - start}


def main(argv: list[str]) -> int:
    result = probe(json.loads(argv[1]))
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
