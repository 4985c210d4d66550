"""The weight sync's wire, shared by every end: the vLLM worker's engine (engine/transfer.py), the trainer's endpoint
(trainer/vllm_client.py) and `dualrun check`'s rehearsal (probe.py) meet the same way (`group_store`).

Why its own module: the trainer side is a worker (dualrun/rank/) and must not import a server program to agree
with it; every end imports the wire from here. Standard library only at import (vLLM's plugin loader imports the
backend's name in every vLLM process); `group_store` imports torch, `open_group` vLLM, when called.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Iterable, Iterator, TypeVar

from dualrun.contract.protocol import WEIGHT_SYNC_TIMEOUT_S

T = TypeVar("T")

GLOO_BACKEND = "gloo"   # the name in `--weight-transfer-config` and in the server's reported config

# Packed chunks of 64 MiB, not vLLM's 1 GiB default: on a CPU each chunk is one more copy of that many bytes in RAM.
PACKED_BUFFER_BYTES = 64 * 1024 * 1024
# The unit each rank passes on down the chain: small enough that a relay adds little delay per hop (4 MiB: 34 ms at
# 1 Gbit/s), large enough that gloo's per-message cost stays small beside the bytes.
SEGMENT_BYTES = 4 * 1024 * 1024
# A tensor this big travels in segments of its own, sent from the trainer's tensor itself (no copy); the smaller
# ones (norms, biases) are packed together.
ALONE_BYTES = 1024 * 1024

GROUP_TIMEOUT_S = 600   # one collective of the weight-sync group (a chunk); a vanished peer fails within it
# Forming the group, on every end (the `weight_sync_timeout_s` key, passed in DUALRUN_WEIGHT_SYNC_TIMEOUT_S): a member
# that never comes (a wrong address or port, an interface or filter between the machines) ends the job in this time
# instead of the store's and gloo's own 600 s each, one after the other.
FORM_TIMEOUT_S = 120.0
FORM_TIMEOUT_ENV = WEIGHT_SYNC_TIMEOUT_S


class GroupNotFormed(RuntimeError):
    """The weight-sync group did not form within its bound; the message names this end and the other."""


def form_timeout_s(environ: "dict[str, str] | None" = None) -> float:
    """The bound on forming the group: DUALRUN_WEIGHT_SYNC_TIMEOUT_S where the job set it, else FORM_TIMEOUT_S."""
    import os

    text = (os.environ if environ is None else environ).get(FORM_TIMEOUT_ENV, "")
    try:
        value = float(text)
    except ValueError:
        return FORM_TIMEOUT_S
    return value if 0 < value < float("inf") else FORM_TIMEOUT_S


def cut_chunks(items: Iterable[T], size_of: Callable[[T], int], buffer_bytes: int) -> Iterator[list[T]]:
    """Pure: `items` grouped into packed chunks as they come (the trainer reads its parameters one by one): a chunk
    ends with the item that takes it past `buffer_bytes` (`size_of` bytes each), vLLM's `pack_tensors` rule, so a
    tensor bigger than the buffer is a chunk of its own."""
    chunk: list[T] = []
    total = 0
    for item in items:
        chunk.append(item)
        total += size_of(item)
        if total > buffer_bytes:
            yield chunk
            chunk, total = [], 0
    if chunk:
        yield chunk


def chunk_bounds(sizes: list[int], buffer_bytes: int) -> list[tuple[int, int]]:
    """Pure: (start, stop) of each packed chunk over tensors of `sizes` bytes (`cut_chunks`), so the receiver sizes
    the same chunks the trainer sends."""
    return [(chunk[0], chunk[-1] + 1) for chunk in cut_chunks(range(len(sizes)), sizes.__getitem__, buffer_bytes)]


def segment_bounds(sizes: list[int], segment_bytes: int = SEGMENT_BYTES,
                   alone_bytes: int = ALONE_BYTES) -> list[tuple[int, int]]:
    """Pure: (start, stop) of each segment of a chunk whose tensors are `sizes` bytes, laid end to end: the unit
    every rank receives and passes on, so a rank forwards a segment while the next is still arriving. A tensor of
    `alone_bytes` or more is cut into segments of its own (`segment_bytes` each, the last shorter), which the
    trainer sends from the tensor itself; smaller tensors are grouped, up to `segment_bytes`, into segments it packs."""
    bounds: list[tuple[int, int]] = []
    run, offset = None, 0   # run: where the open group of small tensors starts
    for size in sizes:
        if size >= alone_bytes:
            if run is not None and offset > run:
                bounds.append((run, offset))
            run = None
            bounds += [(a, min(a + segment_bytes, offset + size)) for a in range(offset, offset + size, segment_bytes)]
        else:
            if run is not None and offset + size - run > segment_bytes:
                bounds.append((run, offset))
                run = None
            run = offset if run is None else run
        offset += size
    if run is not None and offset > run:
        bounds.append((run, offset))
    return bounds


def chain_neighbours(rank: int, world_size: int) -> tuple[int | None, int | None]:
    """Pure: (the rank this one receives from, the rank it passes each segment on to) in the group's chain 0 -> 1
    -> ... -> world_size - 1; None at either end. The engines' ranks come from their `rank_offset`, so the chain is
    the trainer, then each replica's workers in the router's order."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a group of {world_size}")
    return (rank - 1 if rank > 0 else None), (rank + 1 if rank + 1 < world_size else None)


def tcp_store(address: str, port: int, rank: int, world_size: int, timeout: timedelta) -> Any:
    """The group's rendezvous: a TCPStore that rank 0 (the trainer) hosts on `port`, the others join.

    Why not `stateless_init_torch_distributed_process_group`: it meets through torch's `rendezvous`, which under
    torchrun (TORCHELASTIC_USE_AGENT_STORE) joins the agent's store as a client instead of hosting one on `port`,
    so the trainer's rank 0 would host nothing and every member would wait."""
    from torch.distributed import TCPStore

    from dualrun.light.loopback_store import LOOPBACK_HOSTS, loopback_listener

    # torch's store listens on every interface whatever its host; at a loopback address, on that address alone
    listen = {"master_listen_fd": loopback_listener(address, port)} if rank == 0 and address in LOOPBACK_HOSTS else {}
    return TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False,
                    **listen)


def group_store(store: Any, address: str, port: int) -> Any:
    """The keys of one group on `store`: every member of a group at `address:port` prefixes them alike."""
    from torch.distributed import PrefixStore

    return PrefixStore(f"dualrun-gloo:{address}:{port}", store)


def open_group(address: str, port: int, rank: int, world_size: int, form_s: float | None = None) -> Any:
    """This process's member of the weight-sync group (gloo, as vLLM's own utility builds one), formed within
    `form_s` (default `form_timeout_s()`: reaching rank 0's store, every member's address, gloo's full mesh) or
    GroupNotFormed naming rank 0's address and port; each collective after that has GROUP_TIMEOUT_S."""
    import time

    from vllm.distributed.utils import init_gloo_process_group

    form_s = form_timeout_s() if form_s is None else form_s
    start = time.monotonic()
    try:
        store = tcp_store(address, port, rank, world_size, timedelta(seconds=form_s))
        left = max(1.0, form_s - (time.monotonic() - start))
        group = init_gloo_process_group(group_store(store, address, port), rank, world_size,
                                        timedelta(seconds=left))
    except Exception as e:   # torch's DistStoreError / RuntimeError (gloo): the bound, or a refusal within it
        raise GroupNotFormed(f"rank {rank} of {world_size} did not form the weight-sync group with trainer rank 0 at "
                             f"{address}:{port} within {form_s:g} s (weight_sync_timeout_s; it waited "
                             f"{time.monotonic() - start:.0f} s): {_first_line(e)}") from e
    group.set_timeout(timedelta(seconds=GROUP_TIMEOUT_S))   # formed: each transfer gets the group's own bound
    return group


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300]}" if text else type(error).__name__


def close_group(group: Any) -> None:
    group.shutdown()
