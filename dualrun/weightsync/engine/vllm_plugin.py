"""vLLM general plugin (entry point `vllm.general_plugins`): registers the `gloo` weight-transfer engine.

Why a plugin: vLLM's own engines (NCCL, IPC, ...) need CUDA; vLLM loads general plugins in each of its processes
(API server, engine core, workers) before a worker creates its engine from `--weight-transfer-config`, so
`{"backend": "gloo"}` resolves there to `dualrun.weightsync.engine.transfer`. Registration is lazy (a module path), so
every other vLLM process on a machine with dualrun installed pays one dict entry and no import.
"""
from __future__ import annotations

from dualrun.weightsync.wire import GLOO_BACKEND


def register() -> None:
    """Add `gloo` to vLLM's weight-transfer registry, once per process (vLLM may call plugins more than once)."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:   # a vLLM without the weight-transfer registry (< 0.28): nothing to extend
        return
    if GLOO_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(GLOO_BACKEND, "dualrun.weightsync.engine.transfer",
                                                    "GlooWeightTransferEngine")

