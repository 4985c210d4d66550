"""vLLM general plugin (entry point `vllm.general_plugins`): registers the `gloo` weight-transfer engine.

Why a plugin: vLLM's own engines (NCCL, IPC, ...) need CUDA; vLLM loads general plugins in each of its processes
(API server, engine core, workers) before a worker creates its engine from `--weight-transfer-config`, so
`{"backend": "gloo"}` resolves there to `dualrun.serving.gloo_transfer`. Registration is lazy (a module path), so
every other vLLM process on a machine with dualrun installed pays one dict entry and no import.
"""
from __future__ import annotations

GLOO_BACKEND = "gloo"   # the name in `--weight-transfer-config` and in the server's reported config


def register() -> None:
    """Add `gloo` to vLLM's weight-transfer registry, once per process (vLLM may call plugins more than once)."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:   # a vLLM without the weight-transfer registry (< 0.28): nothing to extend
        return
    if GLOO_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(GLOO_BACKEND, "dualrun.serving.gloo_transfer",
                                                    "GlooWeightTransferEngine")


# -- the wire both sides agree on (the vLLM worker's engine and the trainer's endpoint, dualrun/rank/gloo_client.py)
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
