"""The weight stream through the sync group: the trainer (rank 0) sends its tensors, chunked as vLLM packs them
(`wire.cut_chunks`), down a chain of the group's ranks, 0 -> 1 -> ... -> world_size - 1, in segments
(`wire.segment_bounds`) that each rank passes on as soon as it has them.

Why a chain and not the group's broadcast: gloo's broadcast (gloo/broadcast.cc) is a binomial tree over whole
messages: the root posts the full chunk to each of its ceil(log2(world_size)) children at once, and a rank forwards
only once it holds the whole chunk. The trainer's own link then carries 1, 2 and 3 copies of the model for 1, 2 and
4 replicas. A chain of segments puts one copy on every link and adds one segment's time per hop, so a sync to four
replicas takes about the time of one (the pipelined broadcast NCCL uses for large messages).

No needless copies: a segment inside one tensor (every segment of a big tensor) is sent from the tensor itself; only
runs of small tensors are packed, into one of two buffers kept from sync to sync (chunk k+1's while chunk k's are on
the wire; gloo's sends run on its own threads). A receiving rank takes each chunk into one of two reused buffers on
a relay thread, which has every segment's receive posted and passes each segment on as it arrives, while the caller
loads the chunk before from views of its buffer; a buffer something still holds a view of (vLLM's layerwise reload
keeps a layer's weights until the layer is complete) is left to its holder and a new one taken.

torch only (no vLLM): the trainer, the engine, `dualrun check`'s probe and the benchmark use it alike.
"""
from __future__ import annotations

import bisect
import itertools
import mmap
import queue
import threading
import time
from typing import Any, Callable, Iterable

import torch

from dualrun.weightsync.wire import (ALONE_BYTES, PACKED_BUFFER_BYTES, SEGMENT_BYTES, chain_neighbours, cut_chunks,
                                    segment_bounds)

BUFFERS = 2   # chunks in hand at once on every rank: one on the wire, one being packed (or loaded)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 view (a copy only where it is not contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def unpack(chunk: torch.Tensor, dtypes: list[torch.dtype], shapes: list[list[int]]) -> list[torch.Tensor]:
    """The tensors of a packed chunk as views of it, in order; a copy only where a tensor's offset is not a multiple
    of its element size (a view of another dtype needs that)."""
    out, offset = [], 0
    for dtype, shape in zip(dtypes, shapes, strict=True):
        size = dtype.itemsize * _numel(shape)
        part = chunk[offset:offset + size]
        if offset % dtype.itemsize:
            part = part.clone()
        out.append(part.view(dtype).view(shape))
        offset += size
    if offset != chunk.numel():
        raise ValueError(f"the chunk holds {chunk.numel()} bytes, its tensors {offset}")
    return out


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _retained(size: int, buffer_bytes: int) -> bool:
    """Whether a buffer of `size` bytes is kept for the next chunks: up to twice the chunk size (a chunk ends with
    the tensor that takes it past the size); a bigger chunk is one tensor, whose buffer is freed after it."""
    return size <= 2 * buffer_bytes


def _use_count(tensor: torch.Tensor) -> int | None:
    """How many tensors share `tensor`'s memory (None where this torch does not say)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return None if count is None else count(tensor.untyped_storage()._cdata)


_ALONE = _use_count(torch.empty(1))   # the count of a tensor that shares its memory with nothing


class Sender:
    """Rank 0 of the chain: sends each chunk's segments to the next rank, a segment inside one tensor from the tensor
    itself, a segment of small tensors packed into one of two buffers kept from sync to sync (chunk k+1's while
    chunk k's are on the wire). `stats`: the last send's bytes, chunks, the seconds spent packing and waiting for
    the wire."""

    def __init__(self, group: Any, buffer_bytes: int = PACKED_BUFFER_BYTES, segment_bytes: int = SEGMENT_BYTES,
                 to_rank: int = 1, alone_bytes: int = ALONE_BYTES) -> None:
        self.group, self.buffer_bytes, self.segment_bytes, self.to_rank = group, buffer_bytes, segment_bytes, to_rank
        self.alone_bytes = alone_bytes
        self.buffers: list[torch.Tensor | None] = [None] * BUFFERS
        self.stats: dict[str, float] = {}

    def send(self, tensors: Iterable[torch.Tensor]) -> int:
        """Every tensor's bytes, in order, chunked as `wire.cut_chunks`; returns when all have left. The bytes sent."""
        stats = {"bytes": 0, "chunks": 0, "pack_s": 0.0, "wait_s": 0.0}
        self.stats = stats
        in_flight: list[list[Any]] = [[] for _ in range(BUFFERS)]   # per buffer: the sends of the chunk packed in it
        direct: list[Any] = []                                      # sends from the tensors themselves
        slot, tag = 0, 0
        try:
            for chunk in cut_chunks((as_bytes(t) for t in tensors), torch.Tensor.numel, self.buffer_bytes):
                sizes = [t.numel() for t in chunk]
                starts = list(itertools.accumulate([0, *sizes[:-1]]))
                buffer = None
                for start, stop in segment_bounds(sizes, self.segment_bytes, self.alone_bytes):
                    i = bisect.bisect_right(starts, start) - 1   # the tensor the segment starts in
                    if stop <= starts[i] + sizes[i]:
                        direct.append(self.group.send([chunk[i][start - starts[i]:stop - starts[i]]], self.to_rank,
                                                      tag))
                    else:
                        if buffer is None:   # the chunk's first packed segment: the buffer's last chunk has left
                            stats["wait_s"] += _wait(in_flight[slot])
                            buffer, works = self._buffer(slot, sum(sizes)), in_flight[slot]
                            slot = (slot + 1) % BUFFERS
                        t0 = time.perf_counter()
                        self._pack(buffer, chunk, start, stop)
                        stats["pack_s"] += time.perf_counter() - t0
                        works.append(self.group.send([buffer[start:stop]], self.to_rank, tag))
                    tag += 1
                stats["bytes"] += sum(sizes)
                stats["chunks"] += 1
                del chunk, buffer
            for i in range(BUFFERS):   # the older chunk first
                stats["wait_s"] += _wait(in_flight[(slot + i) % BUFFERS])
            stats["wait_s"] += _wait(direct)
        finally:
            for i, size in enumerate(b.numel() if b is not None else 0 for b in self.buffers):
                if not _retained(size, self.buffer_bytes):
                    self.buffers[i] = None
        return int(stats["bytes"])

    def _buffer(self, slot: int, size: int) -> torch.Tensor:
        buffer = self.buffers[slot]
        if buffer is None or buffer.numel() < size:
            buffer = self.buffers[slot] = torch.empty(size, dtype=torch.uint8)
        return buffer[:size]

    @staticmethod
    def _pack(buffer: torch.Tensor, chunk: list[torch.Tensor], start: int, stop: int) -> None:
        """Bytes `start:stop` of the chunk's tensors, laid end to end, into the same bytes of `buffer`."""
        offset = 0
        for t in chunk:
            end = offset + t.numel()
            if end > start and offset < stop:
                a, b = max(start, offset), min(stop, end)
                copy_bytes(buffer[a:b], t[a - offset:b - offset])
            if end >= stop:
                return
            offset = end


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst[:] = src` (uint8, contiguous) on this thread alone: numpy's memcpy, not torch's copy, which splits a
    large copy over the intra-op threads; on a busy CPU those threads wait for each other (411 MB: 0.2 s on one
    thread, 0.8-1.2 s on two under a load of 12 on 2 cores), and the cores are better left to gloo's threads."""
    try:
        numpy_dst, numpy_src = dst.numpy(), src.numpy()
    except RuntimeError:   # no numpy in this environment
        dst.copy_(src)
        return
    numpy_dst[...] = numpy_src


HUGE_PAGE_BYTES = 2 << 20   # below this a buffer is left to torch's allocator


def fresh_buffer(size: int) -> torch.Tensor:
    """A new receive buffer of `size` bytes, backed by transparent huge pages where Linux offers them.

    Why: a receiving rank takes a fresh buffer for every chunk vLLM's layerwise reload still holds a view of (most
    of them), and the kernel fills it on its first touch, while gloo's thread writes the bytes: with 4 KiB pages
    that is a page fault per 4 KiB, the largest share of the receiving thread's CPU. Where transparent huge pages
    are `madvise` (a common default), an anonymous mapping advised `MADV_HUGEPAGE` faults in 2 MiB at a time: on 2
    cores a 411 MB sync to one vLLM CPU engine went from 0.37 to 0.48 of a plain broadcast's speed (median of 4)."""
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if size < HUGE_PAGE_BYTES or advise is None:
        return torch.empty(size, dtype=torch.uint8)
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        memory.madvise(advise)
    except OSError:   # THP off in this kernel: the mapping still serves, in small pages
        pass
    return torch.frombuffer(memory, dtype=torch.uint8)   # the tensor keeps the mapping alive


def _wait(works: list[Any]) -> float:
    """Wait for `works` in order, then empty the list (also when one fails); the seconds it took."""
    t0 = time.perf_counter()
    try:
        for work in works:
            work.wait()
    finally:
        works.clear()
    return time.perf_counter() - t0


class _Failed:
    """A send that could not be posted: waiting for it raises why."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def wait(self) -> None:
        raise self.error


class Receiver:
    """A rank after 0 in the chain: takes each chunk from the rank before it into one of two reused buffers, passes
    every segment on to the rank after it as it arrives (a relay thread), and hands each whole chunk to `load`.
    `stats`: the last receive's bytes, the seconds waiting for the wire, in `load`, and for the segments passed on.

    A failed `load`, or a rank after this one gone, does not stop the stream here: the rest still arrives (and goes
    on, while the next rank takes it), so the ranks before finish their sync and hear of the failure from this
    rank's answer instead of waiting out the group's timeout; `receive` raises the first failure at the end."""

    def __init__(self, group: Any, rank: int, world_size: int, buffer_bytes: int = PACKED_BUFFER_BYTES,
                 segment_bytes: int = SEGMENT_BYTES, alone_bytes: int = ALONE_BYTES) -> None:
        self.group, self.buffer_bytes, self.segment_bytes = group, buffer_bytes, segment_bytes
        self.alone_bytes = alone_bytes
        self.prev, self.next = chain_neighbours(rank, world_size)
        if self.prev is None:
            raise ValueError("rank 0 sends (Sender); a Receiver is a rank after it")
        self.free: list[torch.Tensor] = []   # buffers nothing else holds, for the next chunks
        self._free_lock = threading.Lock()    # the relay thread takes from `free`, the caller's gives back
        self.stats: dict[str, float] = {}

    def receive(self, chunks: list[list[int]], load: Callable[[int, torch.Tensor], None]) -> int:
        """Each chunk, given as its tensors' sizes in bytes, in order: `load(index, chunk)` once it is here (and on
        its way to the next rank). The chunk is a view of a buffer reused after `load` returns, unless something kept
        a view of it. Returns when every chunk is loaded and passed on; the bytes received."""
        self.stats = stats = {"bytes": 0, "chunks": 0, "recv_s": 0.0, "load_s": 0.0, "wait_s": 0.0}
        arrived: queue.Queue = queue.Queue()
        permits = threading.Semaphore(BUFFERS)
        stop, forward = threading.Event(), threading.Event()
        forward.set()   # cleared once the next rank is gone
        relay = threading.Thread(target=self._relay, args=(chunks, arrived, permits, stop, forward),
                                 daemon=True, name="dualrun-weight-relay")
        relay.start()
        failed: Exception | None = None
        loading = True   # until a load fails: the chunks after it are taken (and passed on), not loaded
        try:
            for index in range(len(chunks)):
                item = arrived.get()
                if isinstance(item, BaseException):   # the rank before is gone: nothing more arrives
                    raise item
                buffer, size, sends = item
                t0 = time.perf_counter()
                try:
                    if loading:
                        load(index, buffer[:size])
                except Exception as e:  # noqa: BLE001 - raised at the end, once the stream has passed
                    failed, loading = failed or e, False
                stats["load_s"] += time.perf_counter() - t0
                try:
                    stats["wait_s"] += _wait(sends)
                except Exception as e:  # noqa: BLE001 - the next rank is gone: take the rest, pass nothing on
                    forward.clear()
                    failed = failed or e
                self._release(buffer)
                del buffer, item, sends
                stats["bytes"] += size
                stats["chunks"] += 1
                permits.release()
            relay.join()
        finally:
            stop.set()
            permits.release()   # a relay thread waiting for a buffer sees the stop
        if failed is not None:
            raise failed
        return int(stats["bytes"])

    def _relay(self, chunks: list[list[int]], arrived: queue.Queue, permits: threading.Semaphore,
               stop: threading.Event, forward: threading.Event) -> None:
        """The relay thread: every segment from the rank before, on to the rank after, one chunk ahead of `load`."""
        tag = 0
        try:
            for sizes in chunks:
                permits.acquire()
                if stop.is_set():
                    return
                size = sum(sizes)
                buffer = self._take(size)
                bounds = segment_bounds(sizes, self.segment_bytes, self.alone_bytes)
                # every segment's receive posted at once: the bytes flow in while this thread waits for a core
                recvs = [self.group.recv([buffer[a:b]], self.prev, tag + i) for i, (a, b) in enumerate(bounds)]
                sends: list[Any] = []
                work = None
                for i, ((start, stop_at), work) in enumerate(zip(bounds, recvs)):
                    t0 = time.perf_counter()
                    work.wait()
                    self.stats["recv_s"] += time.perf_counter() - t0
                    if self.next is not None and forward.is_set():
                        try:
                            sends.append(self.group.send([buffer[start:stop_at]], self.next, tag + i))
                        except Exception as e:  # noqa: BLE001 - the next rank is gone: said where it is waited for
                            forward.clear()
                            sends.append(_Failed(e))
                tag += len(bounds)
                item = (buffer, size, sends)
                del buffer, sends, recvs, work   # no view of the buffer left here once the caller has it
                arrived.put(item)
                del item
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            arrived.put(e)

    def _take(self, size: int) -> torch.Tensor:
        """The smallest free buffer that holds `size` bytes, else a new one (replacing a free one too small, unless
        the chunk is too big to keep a buffer for)."""
        with self._free_lock:
            fits = sorted((b.numel(), i) for i, b in enumerate(self.free) if b.numel() >= size)
            if fits:
                return self.free.pop(fits[0][1])
            if self.free and _retained(size, self.buffer_bytes):
                self.free.pop(0)
        return fresh_buffer(size)

    def _release(self, buffer: torch.Tensor) -> None:
        """Keep `buffer` for a next chunk if no other tensor shares its memory (a view the loader kept)."""
        count = _use_count(buffer)
        if count is None or _ALONE is None or count > _ALONE or not _retained(buffer.numel(), self.buffer_bytes):
            return
        with self._free_lock:
            if len(self.free) < BUFFERS:
                self.free.append(buffer)
