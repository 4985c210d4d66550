"""The weight sync's wire, shared by every end: the vLLM worker's engine (engine/transfer.py), the trainer's endpoint
(trainer/vllm_client.py) and `dualrun check`'s rehearsal (probe.py) meet the same way (`group_store`).

Why its own module: the trainer side is a worker (dualrun/rank/) and must not import a server program to agree
with it; every end imports the wire from here. Standard library only at import (vLLM's plugin loader imports the
backend's name in every vLLM process); `group_store` imports torch, `open_group` vLLM, when called.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any

GLOO_BACKEND = "gloo"   # the name in `--weight-transfer-config` and in the server's reported config

# Packed chunks of 64 MiB, not vLLM's 1 GiB default: on a CPU each chunk is one more copy of that many bytes in RAM.
PACKED_BUFFER_BYTES = 64 * 1024 * 1024
GROUP_TIMEOUT_S = 600   # one collective of the weight-sync group (a chunk); a vanished peer fails within it


def chunk_bounds(sizes: list[int], buffer_bytes: int) -> list[tuple[int, int]]:
    """Pure: (start, stop) of each packed chunk over tensors of `sizes` bytes, cut as vLLM's `pack_tensors` cuts
    them (a chunk ends with the tensor that takes it past `buffer_bytes`), so the receiver sizes the same chunks."""
    bounds, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        total += size
        if total > buffer_bytes:
            bounds.append((start, i + 1))
            start, total = i + 1, 0
    if start < len(sizes):
        bounds.append((start, len(sizes)))
    return bounds


def tcp_store(address: str, port: int, rank: int, world_size: int, timeout: timedelta) -> Any:
    """The group's rendezvous: a TCPStore that rank 0 (the trainer) hosts on `port`, the others join.

    Why not `stateless_init_torch_distributed_process_group`: it meets through torch's `rendezvous`, which under
    torchrun (TORCHELASTIC_USE_AGENT_STORE) joins the agent's store as a client instead of hosting one on `port`,
    so the trainer's rank 0 would host nothing and every member would wait."""
    from torch.distributed import TCPStore

    return TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)


def group_store(store: Any, address: str, port: int) -> Any:
    """The keys of one group on `store`: every member of a group at `address:port` prefixes them alike."""
    from torch.distributed import PrefixStore

    return PrefixStore(f"dualrun-gloo:{address}:{port}", store)


def open_group(address: str, port: int, rank: int, world_size: int) -> Any:
    """This process's member of the weight-sync group (gloo, as vLLM's own utility builds one)."""
    from vllm.distributed.utils import init_gloo_process_group

    timeout = timedelta(seconds=GROUP_TIMEOUT_S)
    store = tcp_store(address, port, rank, world_size, timeout)
    return init_gloo_process_group(group_store(store, address, port), rank, world_size, timeout)


def close_group(group: Any) -> None:
    group.shutdown()
