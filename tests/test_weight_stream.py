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
    """Records `send`/`recv`/`wait` in order. A send's bytes reach `wire` when it is waited for; a recv takes the
    next bytes of `source` when posted."""

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
        n = t.numel()
        t.copy_(torch.frombuffer(bytearray(self.source[self.read:self.read + n]), dtype=torch.uint8))
        self.read += n
        self.events.append(("recv", tag, t.data_ptr(), n))
        return FakeWork(lambda: None)

    def sent(self) -> bytes:
        return b"".join(data for _, data in sorted(self.wire))


def _tensors(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(6, generator=g), torch.randn(3, 2, generator=g).t(),        # 24 B; 24 B, not contiguous
            torch.randn(5, generator=g).to(torch.bfloat16), torch.randn(4, generator=g),   # 10 B (odd offset after)
            torch.randn(2, 5, generator=g), torch.randn(40, generator=g),           # 40 B; 160 B: a chunk alone
            torch.arange(7, dtype=torch.int8), torch.randn(3, generator=g), torch.randn(8, generator=g),  # 7+12+32
            torch.randn(5, generator=g), torch.randn(13, generator=g).half(),        # 20 + 26 B
            torch.randn(2, generator=g)]                                            # 8 B: the last chunk alone


def _bytes(tensors: list[torch.Tensor]) -> bytes:
    return b"".join(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in tensors)


def _chunk_of_tag(sizes: list[int], buffer_bytes: int, segment: int) -> dict[int, int]:
    tags, tag = {}, 0
    for k, (a, b) in enumerate(chunk_bounds(sizes, buffer_bytes)):
        for _ in segment_bounds(sum(sizes[a:b]), segment):
            tags[tag] = k
            tag += 1
    return tags


def test_the_chain_and_the_segments_are_cut_alike_at_both_ends():
    assert [chain_neighbours(r, 4) for r in range(4)] == [(None, 1), (0, 2), (1, 3), (2, None)]
    assert chain_neighbours(0, 1) == (None, None)
    with pytest.raises(ValueError):
        chain_neighbours(4, 4)
    assert segment_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert segment_bounds(8, 4) == [(0, 4), (4, 8)] and segment_bounds(0, 4) == []


def test_the_next_chunk_is_packed_while_the_last_is_on_the_wire_into_two_reused_buffers():
    tensors = _tensors()
    sizes = [t.numel() * t.element_size() for t in tensors]
    group = FakeGroup()
    sender = Sender(group, buffer_bytes=40, segment_bytes=16)
    pack = sender._pack

    def spy(buffer, chunk, start, stop):  # noqa: ANN001 - records each segment packed, then packs it
        group.events.append(("pack",))
        return pack(buffer, chunk, start, stop)
    sender._pack = spy
    assert sender.send(tensors) == sum(sizes)
    assert group.sent() == _bytes(tensors)                  # every byte, in order, as it was when it left

    chunk = _chunk_of_tag(sizes, 40, 16)
    bounds = chunk_bounds(sizes, 40)
    packed = [k for k, (a, b) in enumerate(bounds) if b - a > 1]
    assert [k for k, (a, b) in enumerate(bounds) if b - a == 1] == [2, 5]    # the 160-byte tensor; the last
    ev = group.events
    # each segment is packed right before its send; the chunk a pack is for is that of the send after it
    packs = [(i, chunk[ev[i + 1][1]]) for i, e in enumerate(ev) if e[0] == "pack"]
    assert all(ev[i + 1][0] == "send" for i, _ in packs) and {k for _, k in packs} == set(packed)
    first_wait = {k: min(i for i, e in enumerate(ev) if e[0] == "wait" and chunk[e[1]] == k) for k in packed}
    last_pack = {k: max(i for i, c in packs if c == k) for k in packed}
    for k, nxt in zip(packed, packed[1:]):
        assert last_pack[nxt] < first_wait[k], f"chunk {k} was waited for before chunk {nxt} was packed: {ev}"
    assert len(packed) >= 4

    # the next sync goes through the same two buffers, alternating (grown to its chunks in the first); the
    # one-tensor chunks go from the tensors themselves
    again = FakeGroup()
    sender.group = again
    other = _tensors(seed=1)
    sender.send(other)
    assert again.sent() == _bytes(other)
    first_send: dict[int, int] = {}
    for e in again.events:
        if e[0] == "send":
            first_send.setdefault(chunk[e[1]], e[2])
    assert first_send[packed[0]] == first_send[packed[2]] != first_send[packed[1]] == first_send[packed[3]]
    assert {first_send[packed[0]], first_send[packed[1]]} == {b.data_ptr() for b in sender.buffers}
    assert first_send[2] == other[5].data_ptr() and first_send[5] == other[11].data_ptr()


def test_a_relay_passes_each_segment_on_before_the_rest_of_its_chunk_arrives():
    tensors = _tensors()
    sizes = [t.numel() * t.element_size() for t in tensors]
    payload = _bytes(tensors)
    bounds = chunk_bounds(sizes, 40)
    chunk_sizes = [sum(sizes[a:b]) for a, b in bounds]
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

    receiver = Receiver(group, rank=1, world_size=3, buffer_bytes=40, segment_bytes=16)
    assert receiver.receive(chunk_sizes, load) == len(payload)
    assert b"".join(loaded) == payload and group.sent() == payload    # loaded here, and passed on whole
    ev = [e for e in group.events if e[0] in ("recv", "send")]
    for i, e in enumerate(ev):
        if e[0] == "recv":
            assert ev[i + 1][:2] == ("send", e[1]), "a segment waited for the rest of its chunk before it went on"
    # chunks of 48, 66, 160, 51, 46, 8 bytes: two buffers, each reused once its chunk is loaded; the 160-byte
    # chunk (more than twice the chunk size: one tensor) in a buffer of its own, not kept
    assert chunk_sizes == [48, 66, 160, 51, 46, 8]
    assert ptrs[3] == ptrs[1] == ptrs[5] != ptrs[0] == ptrs[4] and ptrs[2] not in (ptrs[0], ptrs[1])


def test_a_buffer_still_viewed_by_the_loader_is_not_reused():
    """vLLM's layerwise reload keeps a layer's weights until the layer is complete: such a buffer is left alone."""
    tensors = _tensors()
    sizes = [t.numel() * t.element_size() for t in tensors]
    payload = _bytes(tensors)
    chunk_sizes = [sum(sizes[a:b]) for a, b in chunk_bounds(sizes, 40)]
    kept: list[torch.Tensor] = []

    def load(index: int, chunk: torch.Tensor) -> None:
        if index == 0:
            kept.append(chunk[:8])
    Receiver(FakeGroup(payload), 2, 3, buffer_bytes=40, segment_bytes=16).receive(chunk_sizes, load)
    assert kept[0].numpy().tobytes() == payload[:8]


def test_the_last_rank_passes_nothing_on_and_an_error_on_the_wire_reaches_the_caller():
    group = FakeGroup(bytes(range(20)))
    Receiver(group, 1, 2, segment_bytes=8).receive([20], lambda i, c: None)
    assert [e[0] for e in group.events] == ["recv"] * 3

    class Broken(FakeGroup):
        def recv(self, tensors, src, tag):  # noqa: ANN001
            raise RuntimeError("Connection closed by peer")
    with pytest.raises(RuntimeError, match="closed by peer"):
        Receiver(Broken(), 1, 2).receive([20, 20, 20], lambda i, c: None)


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
    sizes = [t.numel() * t.element_size() for t in tensors]
    bounds = chunk_bounds(sizes, 40)
    got: dict[int, list[torch.Tensor]] = {1: [], 2: []}
    errors: list[BaseException] = []

    def receive(rank: int) -> None:
        def load(index: int, chunk: torch.Tensor) -> None:
            a, b = bounds[index]
            got[rank] += [p.clone() for p in unpack(chunk, [t.dtype for t in tensors[a:b]],
                                                    [list(t.shape) for t in tensors[a:b]])]
        try:
            Receiver(groups[rank], rank, 3, buffer_bytes=40, segment_bytes=16).receive(
                [sum(sizes[a:b]) for a, b in bounds], load)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
    sender = Sender(groups[0], buffer_bytes=40, segment_bytes=16)
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
        Receiver(group, 1, 3, segment_bytes=100).receive([200, 200, 200], lambda i, c: loaded.append(i))
    assert group.read == len(payload) and loaded == [0, 1, 2]      # all taken and loaded here
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
                [1000] * 12, load)
        except Exception as e:  # noqa: BLE001
            outcome[rank] = e
    threads = [threading.Thread(target=receive, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    assert Sender(groups[0], buffer_bytes=999, segment_bytes=400).send(tensors) == 12_000
    for t in threads:
        t.join(30)
    assert isinstance(outcome[1], ValueError) and outcome[2] == 12_000 and got == [float(i) for i in range(12)]
