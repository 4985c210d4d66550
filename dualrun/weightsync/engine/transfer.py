"""vLLM's weight-transfer engine over gloo: the trainer's weights reach a vLLM CPU engine without CUDA or NCCL.

Loaded inside vLLM's worker processes (registered by `dualrun.weightsync.engine.vllm_plugin`, created by the worker from
`--weight-transfer-config '{"backend": "gloo"}'`). The same `init_info` fields as vLLM's NCCL engine
(`master_address`, `master_port`, `rank_offset`, `world_size`, `packed`), so TRL's client and dualrun's router
drive it unchanged: the trainer is rank 0 of a stateless torch.distributed group (vLLM's
`init_gloo_process_group` over a TCPStore the trainer hosts), each worker joins at `rank_offset` plus its rank,
and every update streams down the group's chain of ranks (`dualrun.weightsync.stream`: each worker takes the
chunks from the rank before it and passes every segment on to the rank after it), packed into byte chunks
(`dualrun.weightsync.wire.chunk_bounds`) or one tensor at a time. Received weights load, from views of the received
chunk, through vLLM's layerwise reload, as NCCL's do, so layers whose kernels repack their weights (the CPU linear
layers) are processed again.

Imports vLLM: only vLLM's processes import it; what the trainer shares with it (the chunks, the group, the chain)
is dualrun.weightsync.wire and dualrun.weightsync.stream.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

from dualrun.weightsync.stream import Receiver, unpack
from dualrun.weightsync.wire import PACKED_BUFFER_BYTES, GroupNotFormed, chunk_bounds, close_group, open_group


@dataclass(kw_only=True)
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    packed: bool = False
    packed_buffer_size_bytes: int = PACKED_BUFFER_BYTES
    packed_num_buffers: int = 2   # accepted for NCCL-shaped clients; the gloo stream keeps two (stream.BUFFERS)


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"names, dtype_names and shapes differ in length: {len(self.names)}, "
                             f"{len(self.dtype_names)}, {len(self.shapes)}")


def refresh_tied_heads(model: torch.nn.Module) -> None:
    """Re-pack an output head tied to the input embedding (`tie_word_embeddings`) from the reloaded weight.

    Why: the trainer sends no `lm_head.weight` for a tied model, so vLLM 0.32's layerwise reload leaves the head's
    layer unprocessed ("ParallelLMHead: Failed to load weights"): its storage, shared with the embedding, holds the new
    values, but on CPU the logits run on the copy packed at load time (`cpu_linear`), which stays stale. Processing
    the head again packs the new values (unquantized heads only: their processing only re-packs)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (ParallelLMHead, UnquantizedEmbeddingMethod,
                                                                     VocabParallelEmbedding)

    embeddings = {m.weight.data_ptr() for m in model.modules()
                  if type(m) is VocabParallelEmbedding and hasattr(m, "weight")}
    for head in model.modules():
        if (isinstance(head, ParallelLMHead) and isinstance(head.quant_method, UnquantizedEmbeddingMethod)
                and head.weight.data_ptr() in embeddings):
            head.quant_method.process_weights_after_loading(head)


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:  # noqa: ANN001 - vLLM's signature
        super().__init__(config, vllm_config, device, model)
        self.group: Any = None
        self.receiver: Receiver | None = None
        self.packed = False
        self.buffer_bytes = PACKED_BUFFER_BYTES

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        """Join the trainer's group; the rank counts every worker of every data-parallel group (as NCCL's)."""
        self.shutdown()   # a new trainer (a restarted job) replaces the previous one's group
        parallel = self.parallel_config
        rank = init_info.rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.packed, self.buffer_bytes = init_info.packed, init_info.packed_buffer_size_bytes
        try:   # bounded by the job's weight_sync_timeout_s (DUALRUN_WEIGHT_SYNC_TIMEOUT_S in this server's env)
            self.group = open_group(init_info.master_address, init_info.master_port, rank, init_info.world_size)
        except GroupNotFormed as e:
            # the server's log says it too: the trainer's line names this replica by its address
            print(f"dualrun gloo weight transfer: this replica's worker {e}", file=sys.stderr, flush=True)
            raise
        self.receiver = Receiver(self.group, rank, init_info.world_size, self.buffer_bytes)
        # stderr, not vLLM's logger: the line must reach the server's log whatever vLLM's logging is set to
        print(f"dualrun gloo weight transfer: rank {rank} of {init_info.world_size} (trainer at "
              f"{init_info.master_address}:{init_info.master_port})", file=sys.stderr, flush=True)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        refresh_tied_heads(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():   # a GPU worker: the loads are queued on its stream
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.receiver is None:
            raise RuntimeError("gloo weight transfer is not initialised: call /init_weight_transfer_engine first")
        names = update_info.names
        dtypes = [getattr(torch, t) for t in update_info.dtype_names]
        shapes = [[int(d) for d in s] for s in update_info.shapes]
        sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in zip(shapes, dtypes)]
        bounds = chunk_bounds(sizes, self.buffer_bytes) if self.packed else [(i, i + 1) for i in range(len(sizes))]

        def load(index: int, chunk: torch.Tensor) -> None:
            start, stop = bounds[index]
            self.model.load_weights(list(zip(names[start:stop], unpack(chunk, dtypes[start:stop],
                                                                       shapes[start:stop]))))
        self.receiver.receive([sizes[start:stop] for start, stop in bounds], load)

    def shutdown(self) -> None:
        self.receiver = None
        if self.group is not None:
            group, self.group = self.group, None
            close_group(group)
