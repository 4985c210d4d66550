"""AsyncGRPOTrainer's weight transfer over gloo: TRL's `WeightTransferClient` with dualrun's gloo group in place of
vLLM's NCCL trainer endpoint.

Why: TRL 1.16's `AsyncGRPOTrainer` syncs through a `weight_transfer=` object (its `WeightTransferProtocol`:
`init_weight_transfer`, `pause`, `send_weights`, `resume`, `destroy`) and, given none, builds `WeightTransferClient`
(`trl/experimental/async_grpo/weight_transfer.py`), which opens the group with vLLM's `nccl_common.trainer_init` and
broadcasts with `packed_nccl_broadcast_producer` (CUDA streams). Against a server that reports the gloo backend
(`dualrun.weightsync.engine.transfer`) only those two calls change: this subclass keeps TRL's HTTP calls, pause and
resume. GRPOPlugin's import hook makes the name the trainer builds pick it for a gloo server (`install`), so a script
that passes no `weight_transfer` is unchanged; a script may also pass `GlooWeightTransferClient(...)` itself.
"""
from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

from trl.experimental.async_grpo.weight_transfer import WeightTransferClient

from dualrun.weightsync.wire import GLOO_BACKEND
from dualrun.weightsync.trainer.vllm_client import open_endpoint, server_backend

_INSTALLED = "_dualrun_gloo"


class GlooWeightTransferClient(WeightTransferClient):
    """TRL's client (`vllm_client`, `weight_update_info`, `weight_sync_timeout`), over a gloo group: rank 0 here."""

    def init_weight_transfer(self) -> None:
        """TRL's init_info (a free port, `rank_offset` 1): the server joins while this process opens the group."""
        from vllm.utils.network_utils import get_open_port

        self.vllm.wait_for_server_ready()
        self.model_update_group = open_endpoint(
            get_open_port(), self.vllm.get_world_size(),
            lambda info: self.vllm.init_weight_transfer_engine(info, timeout=self.weight_sync_timeout),
            getattr(self.vllm, "server_url", None) or getattr(self.vllm, "base_url", "the rollout server"))

    def send_weights(self, iterator: Iterator[tuple[str, Any]]) -> None:
        """TRL's sequence (start, update posted while this process broadcasts, finish), the broadcast over gloo."""
        if self.model_update_group is None:
            return
        self.vllm.start_weight_update(timeout=self._CONTROL_TIMEOUT)
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            received = pool.submit(self.vllm.update_weights, self._weight_update_info, timeout=self.weight_sync_timeout)
            self.model_update_group.send(iterator)
            received.result()
        except Exception as exc:
            with contextlib.suppress(Exception):   # as TRL's: a failed clean-up must not hide the error
                self.vllm.finish_weight_update(timeout=self.weight_sync_timeout)
            raise RuntimeError(f"Weight sync over gloo to the vLLM server at {self.vllm.server_url} failed") from exc
        finally:
            pool.shutdown(wait=False)   # after a failed broadcast the post may never return
        self.vllm.finish_weight_update(timeout=self.weight_sync_timeout)

    def destroy(self) -> None:
        endpoint, self.model_update_group = self.model_update_group, None
        if endpoint is not None:
            endpoint.close()


def install(module: Any) -> None:
    """Make `module.WeightTransferClient` (trl.experimental.async_grpo.async_grpo_trainer, the name AsyncGRPOTrainer
    builds when given no `weight_transfer`) build the gloo client for a server that reports gloo, TRL's otherwise."""
    trl_cls = module.WeightTransferClient
    if getattr(trl_cls, _INSTALLED, False):
        return

    def choose(vllm_client: Any, weight_update_info: dict, weight_sync_timeout: int = 1800) -> WeightTransferClient:
        cls = GlooWeightTransferClient if server_backend(vllm_client) == GLOO_BACKEND else trl_cls
        return cls(vllm_client, weight_update_info, weight_sync_timeout)

    setattr(choose, _INSTALLED, True)
    choose.__doc__ = f"{trl_cls.__doc__ or ''}\n\n(dualrun: over gloo when the server reports the gloo backend.)"
    module.WeightTransferClient = choose
