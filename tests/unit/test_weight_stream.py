"""The weight stream (dualrun.weightsync.stream): the trainer packs chunk k+1 while chunk k is on the wire, into two
buffers it keeps from sync to sync; a one-tensor chunk goes from the tensor itself; every receiving rank passes each
segment on down the chain as it arrives, and loads from views of two reused buffers. The order of pack, send and
wait is read from a fake group that records the calls and takes a send's bytes only when it is waited for (as a
real wire may read them until then); the last test runs the same code over a real gloo group of three ranks."""
from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch

from dualrun.weightsync.stream import Receiver, Sender, unpack
from dualrun.weightsync.wire import chain_neighbours, chunk_bounds, segment_bounds


class FakeWork:
    def __init__(self, done) -> None:   # noqa: ANN001
        self.done = done

    def wait(self) -> None:
        self.done()


class FakeGroup:
    """Records `send`/`recv`/`wait` in order. A send's bytes reach `wire` when it is waited for; a recv's bytes
    (the next of `source` when it was posted) arrive when it is waited for."""

    def __init__(self, source: bytes = b"") -> None:
        self.events: list[tuple] = []
        self.wire: list[tuple[int, bytes]] = []
        self.source, self.read = source, 0

    def send(self, tensors, dst, tag):  # noqa: ANN001
        (t,) = tensors
        self.events.append(("send", tag, t.data_ptr(), t.numel()))

        def done() -> None:
            self.events.append(("wait", tag))
            self.wire.append((tag, bytes(t.numpy().tobytes())))
        return FakeWork(done)

    def recv(self, tensors, src, tag):  # noqa: ANN001
        (t,) = tensors
        n, start = t.numel(), self.read
        self.read += n

        def arrive() -> None:
            t.copy_(torch.frombuffer(bytearray(self.source[start:start + n]), dtype=torch.uint8))
            self.events.append(("recv", tag, t.data_ptr(), n))
        return FakeWork(arrive)

    def sent(self) -> bytes:
        return b"".join(data for _, data in sorted(self.wire))


def _tensors(seed: int = 0) -> list[torch.Tensor]:
    """Chunks of 40 bytes: three small tensors (12 bytes, packed into one segment) then one of 32 bytes (segments of
    its own, sent from it; once not contiguous), a 160-byte tensor (a chunk alone) and an 8-byte one at the end."""
    g = torch.Generator().manual_seed(seed)
    out: list[torch.Tensor] = []
    for k in range(5):
        out += [torch.randn(1, generator=g), torch.randn(2, generator=g).half(), torch.arange(4, dtype=torch.int8),
                torch.randn(4, 2, generator=g).t() if k == 1 else torch.randn(8, generator=g)]
        if k == 2:
            out.append(torch.randn(40, generator=g))
    return out + [torch.randn(2, generator=g)]


BUFFER, SEGMENT, ALONE = 40, 16, 16


def _bytes(tensors: list[torch.Tensor]) -> bytes:
    return b"".join(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in tensors)


def _sizes(tensors: list[torch.Tensor]) -> list[int]:
    return [t.numel() * t.element_size() for t in tensors]


def _per_chunk(tensors: list[torch.Tensor]) -> list[list[int]]:
    sizes = _sizes(tensors)
    return [sizes[a:b] for a, b in chunk_bounds(sizes, BUFFER)]


def _chunk_of_tag(tensors: list[torch.Tensor]) -> dict[int, int]:
    tags, tag = {}, 0
    for k, sizes in enumerate(_per_chunk(tensors)):
        for _ in segment_bounds(sizes, SEGMENT, ALONE):
            tags[tag] = k
            tag += 1
    return tags


def test_the_chain_and_the_segments_are_cut_alike_at_both_ends():
    assert [chain_neighbours(r, 4) for r in range(4)] == [(None, 1), (0, 2), (1, 3), (2, None)]
    assert chain_neighbours(0, 1) == (None, None)
    with pytest.raises(ValueError):
        chain_neighbours(4, 4)
    # a big tensor in pieces of its own; small ones grouped up to a segment; empty tensors in no segment
    assert segment_bounds([10, 1, 1, 20, 0, 3], 8, 8) == [(0, 8), (8, 10), (10, 12), (12, 20), (20, 28), (28, 32),
                                                          (32, 35)]
    assert segment_bounds([3, 3, 3, 3], 8, 8) == [(0, 6), (6, 12)] and segment_bounds([0, 0], 8, 8) == []
    assert segment_bounds([8], 8, 8) == [(0, 8)] and segment_bounds([17], 8, 4) == [(0, 8), (8, 16), (16, 17)]


def test_the_next_chunk_is_packed_while_the_last_is_on_the_wire_into_two_reused_buffers():
    tensors = _tensors()
    group = FakeGroup()
    sender = Sender(group, BUFFER, SEGMENT, alone_bytes=ALONE)
    pack = sender._pack

    def spy(buffer, chunk, start, stop):  # noqa: ANN001 - records each segment packed, then packs it
        group.events.append(("pack",))
        return pack(buffer, chunk, start, stop)
    sender._pack = spy
    assert sender.send(tensors) == sum(_sizes(tensors))
    assert group.sent() == _bytes(tensors)                  # every byte, in order, as it was when it left

    chunk = _chunk_of_tag(tensors)
    per_chunk = _per_chunk(tensors)
    assert [len(c) for c in per_chunk] == [4, 4, 4, 1, 4, 4, 1]
    packed = [0, 1, 2, 4, 5]                               # a packed segment each; chunks 3 and 6: one tensor
    ev = group.events
    packs = [(i, chunk[ev[i + 1][1]]) for i, e in enumerate(ev) if e[0] == "pack"]
    assert all(ev[i + 1][0] == "send" for i, _ in packs) and [k for _, k in packs] == packed
    first_wait = {k: min(i for i, e in enumerate(ev) if e[0] == "wait" and chunk[e[1]] == k) for k in packed}
    for (at, k), (nxt_at, nxt) in zip(packs, packs[1:]):
        assert nxt_at < first_wait[k], f"chunk {k} was waited for before chunk {nxt} was packed: {ev}"

    # the next sync packs into the same two buffers, alternating (grown to its chunks in the first); every other
    # segment goes from the tensor it lies in
    again = FakeGroup()
    sender.group = again
    other = _tensors(seed=1)
    sender.send(other)
    assert again.sent() == _bytes(other)
    sent = [(chunk[e[1]], e[2], e[3]) for e in again.events if e[0] == "send"]
    bases = [b.data_ptr() for b in sender.buffers]
    packed_from = [ptr for k, ptr, n in sent if n == 12]
    assert packed_from[0] == packed_from[2] == packed_from[4] == bases[0]
    assert packed_from[1] == packed_from[3] == bases[1] != bases[0]
    from_tensors = [ptr for _, ptr, n in sent if n != 12]
    assert len(sent) == 5 * 3 + 160 // SEGMENT + 1 and len(from_tensors) == len(sent) - 5
    within = [ptr for ptr in from_tensors if any(t.data_ptr() <= ptr < t.data_ptr() + t.numel() * t.element_size()
                                                 for t in other)]
    assert len(within) == len(from_tensors) - 2   # all but the two of the one not contiguous (sent from its copy)
    assert sender.stats["pack_s"] > 0 and sender.stats["chunks"] == 7


def test_a_relay_passes_each_segment_on_before_the_rest_of_its_chunk_arrives():
    tensors = _tensors()
    payload = _bytes(tensors)
    bounds = chunk_bounds(_sizes(tensors), BUFFER)
    group = FakeGroup(payload)
    loaded: list[bytes] = []
    ptrs: list[int] = []

    def load(index: int, chunk: torch.Tensor) -> None:
        ptrs.append(chunk.data_ptr())
        a, b = bounds[index]
        parts = unpack(chunk, [t.dtype for t in tensors[a:b]], [list(t.shape) for t in tensors[a:b]])
        for got, want in zip(parts, tensors[a:b]):
            assert torch.equal(got, want.contiguous())
        loaded.append(chunk.numpy().tobytes())

    receiver = Receiver(group, rank=1, world_size=3, buffer_bytes=BUFFER, segment_bytes=SEGMENT, alone_bytes=ALONE)
    assert receiver.receive(_per_chunk(tensors), load) == len(payload)
    assert b"".join(loaded) == payload and group.sent() == payload    # loaded here, and passed on whole
    ev = [e for e in group.events if e[0] in ("recv", "send")]
    for i, e in enumerate(ev):
        if e[0] == "recv":
            assert ev[i + 1][:2] == ("send", e[1]), "a segment waited for the rest of its chunk before it went on"
    # chunks of 44, 44, 44, 160, 44, 44, 8 bytes: two buffers, each reused once its chunk is loaded; the 160-byte
    # chunk (more than twice the chunk size: one tensor) in a buffer of its own, not kept
    kept = set(ptrs[:3] + ptrs[4:])
    assert len(kept) == 2 and ptrs[3] not in kept


def test_a_buffer_still_viewed_by_the_loader_is_not_reused():
    """vLLM's layerwise reload keeps a layer's weights until the layer is complete: such a buffer is left alone."""
    tensors = _tensors()
    payload = _bytes(tensors)
    kept: list[torch.Tensor] = []
    ptrs: list[int] = []

    def load(index: int, chunk: torch.Tensor) -> None:
        ptrs.append(chunk.data_ptr())
        if index == 0:
            kept.append(chunk[:8])
    Receiver(FakeGroup(payload), 2, 3, BUFFER, SEGMENT, ALONE).receive(_per_chunk(tensors), load)
    assert kept[0].numpy().tobytes() == payload[:8] and ptrs[0] not in ptrs[1:]


def test_the_last_rank_passes_nothing_on_and_an_error_on_the_wire_reaches_the_caller():
    group = FakeGroup(bytes(range(20)))
    Receiver(group, 1, 2, segment_bytes=8, alone_bytes=8).receive([[20]], lambda i, c: None)
    assert [e[0] for e in group.events] == ["recv"] * 3

    class Broken(FakeGroup):
        def recv(self, tensors, src, tag):  # noqa: ANN001
            raise RuntimeError("Connection closed by peer")
    with pytest.raises(RuntimeError, match="closed by peer"):
        Receiver(Broken(), 1, 2).receive([[20], [20], [20]], lambda i, c: None)


def test_unpack_gives_views_and_copies_only_a_misaligned_tensor():
    chunk = torch.arange(14, dtype=torch.uint8)
    a, b = unpack(chunk, [torch.int32, torch.int16], [[1], [5]])
    assert a.data_ptr() == chunk.data_ptr() and b.data_ptr() == chunk.data_ptr() + 4       # views
    assert b.tolist() == torch.arange(4, 14, dtype=torch.uint8).view(torch.int16).tolist()
    x, y, z = unpack(chunk[:10], [torch.int8, torch.int8, torch.float32], [[1], [1], [2]])
    assert y.data_ptr() == chunk.data_ptr() + 1 and z.data_ptr() != chunk.data_ptr() + 2   # offset 2: a copy
    assert z.view(torch.uint8).tolist() == list(range(2, 10))
    with pytest.raises(ValueError, match="holds 14 bytes"):
        unpack(chunk, [torch.int32], [[2]])


def test_a_chain_of_three_gloo_ranks_delivers_every_tensor_to_each_rank():
    """Real gloo: the trainer's Sender and two relaying Receivers in threads, small chunks and segments."""
    from torch.distributed import HashStore, ProcessGroupGloo

    store = HashStore()
    groups: dict[int, object] = {}

    def join(rank: int) -> None:
        groups[rank] = ProcessGroupGloo(store, rank, 3, timedelta(seconds=30))
    threads = [threading.Thread(target=join, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    tensors = _tensors()
    bounds = chunk_bounds(_sizes(tensors), BUFFER)
    got: dict[int, list[torch.Tensor]] = {1: [], 2: []}
    errors: list[BaseException] = []

    def receive(rank: int) -> None:
        def load(index: int, chunk: torch.Tensor) -> None:
            a, b = bounds[index]
            got[rank] += [p.clone() for p in unpack(chunk, [t.dtype for t in tensors[a:b]],
                                                    [list(t.shape) for t in tensors[a:b]])]
        try:
            Receiver(groups[rank], rank, 3, BUFFER, SEGMENT, ALONE).receive(_per_chunk(tensors), load)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
    sender = Sender(groups[0], BUFFER, SEGMENT, alone_bytes=ALONE)
    for _ in range(2):   # twice: the buffers kept from the first sync carry the second
        got = {1: [], 2: []}
        threads = [threading.Thread(target=receive, args=(r,)) for r in (1, 2)]
        for t in threads:
            t.start()
        sender.send(tensors)
        for t in threads:
            t.join(30)
        assert not errors, errors
        for rank in (1, 2):
            assert len(got[rank]) == len(tensors)
            assert all(torch.equal(g, t.contiguous()) for g, t in zip(got[rank], tensors)), rank


def test_a_relay_whose_next_rank_is_gone_takes_the_rest_then_raises():
    """The ranks before finish their sync (and hear of the failure from this rank's answer), instead of waiting
    out the group's timeout for a rank that stopped receiving."""
    payload = bytes(range(200)) * 3

    class NextGone(FakeGroup):
        def send(self, tensors, dst, tag):  # noqa: ANN001
            if tag >= 3:
                raise RuntimeError("Connection reset by peer")
            return super().send(tensors, dst, tag)
    group, loaded = NextGone(payload), []
    with pytest.raises(RuntimeError, match="reset by peer"):
        Receiver(group, 1, 3, segment_bytes=100, alone_bytes=100).receive([[200], [200], [200]],
                                                                         lambda i, c: loaded.append(i))
    assert group.read == len(payload) and loaded == [0, 1, 2]      # all taken, and loaded here
    assert [e[1] for e in group.events if e[0] == "send"] == [0, 1, 2]   # nothing more offered to the gone rank


def test_a_failed_load_still_passes_the_stream_on_then_raises():
    """Real gloo, three ranks: the middle one's load fails at its second chunk; the trainer's send and the last
    rank's receive complete, and the middle one raises its failure at the end."""
    from torch.distributed import HashStore, ProcessGroupGloo

    store, groups = HashStore(), {}

    def join(rank: int) -> None:
        groups[rank] = ProcessGroupGloo(store, rank, 3, timedelta(seconds=60))
    threads = [threading.Thread(target=join, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    tensors = [torch.full((250,), float(i)) for i in range(12)]      # 12 chunks of 1000 bytes
    outcome: dict[int, object] = {}
    got: list[float] = []

    def receive(rank: int) -> None:
        def load(index: int, chunk: torch.Tensor) -> None:
            if rank == 1 and index == 1:
                raise ValueError("no such parameter")
            if rank == 2:
                got.append(float(chunk.view(torch.float32)[0]))
        try:
            outcome[rank] = Receiver(groups[rank], rank, 3, buffer_bytes=999, segment_bytes=400).receive(
                [[1000]] * 12, load)
        except Exception as e:  # noqa: BLE001
            outcome[rank] = e
    threads = [threading.Thread(target=receive, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    assert Sender(groups[0], buffer_bytes=999, segment_bytes=400).send(tensors) == 12_000
    for t in threads:
        t.join(30)
    assert isinstance(outcome[1], ValueError) and outcome[2] == 12_000 and got == [float(i) for i in range(12)]


def test_empty_tensors_make_empty_chunks_at_both_ends():
    group = FakeGroup()
    assert Sender(group, buffer_bytes=8).send([torch.empty(0), torch.empty(0, 3)]) == 0 and group.events == []
    loaded: list[int] = []
    assert Receiver(FakeGroup(), 1, 2).receive([[0]], lambda i, c: loaded.append(c.numel())) == 0 and loaded == [0]


def _smaps_entry(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds `address`."""
    import re

    fields, inside = {}, False
    for line in open("/proc/self/smaps").read().splitlines():
        span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            inside = int(span.group(1), 16) <= address < int(span.group(2), 16)
        elif inside and ":" in line:
            key, value = line.split(":", 1)
            fields[key] = value.strip()
    return fields


def test_a_fresh_receive_buffer_is_advised_huge_pages_and_holds_its_bytes():
    import gc
    import os

    from dualrun.weightsync.stream import HUGE_PAGE_BYTES, fresh_buffer

    small = fresh_buffer(1000)
    assert small.dtype == torch.uint8 and small.numel() == 1000
    buffer = fresh_buffer(3 * HUGE_PAGE_BYTES + 5)
    assert buffer.dtype == torch.uint8 and buffer.numel() == 3 * HUGE_PAGE_BYTES + 5
    view = buffer[HUGE_PAGE_BYTES:HUGE_PAGE_BYTES + 16]
    del buffer
    gc.collect()
    view.copy_(torch.arange(16, dtype=torch.uint8))   # the mapping lives as long as a view of it
    assert view.tolist() == list(range(16))
    policy = "/sys/kernel/mm/transparent_hugepage/enabled"
    thp = open(policy).read() if os.path.exists(policy) else "[never]"
    fields = _smaps_entry(view.data_ptr())
    if "[never]" in thp or "THPeligible" not in fields:
        pytest.skip(f"no transparent huge pages here ({thp.strip()})")
    assert fields["THPeligible"] == "1", fields
