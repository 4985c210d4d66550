"""Trainer side of a separate teacher: a module that looks like the teacher model but asks its server.

Why a stand-in module: GKD's trainer calls `self.teacher_model(input_ids=..., attention_mask=...).logits`; replacing
the model by this module moves that forward to the teacher role over the network and leaves the user's script and
TRL's loss untouched. The server returns only the top-k log-probabilities per position (TRL's `VLLMClient`
asks for them), so the logits it hands back describe the top-k tokens exactly and spread the remaining mass
evenly over the other tokens: top-k distillation with a tail, never full vocabulary.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn


def teacher_client(base_url: str, timeout_s: float = 60.0) -> Any:
    """TRL's `VLLMClient` for `base_url`. Its scoring call needs only HTTP, so where vLLM is not installed (the
    CPU engine) the client is built without the import check that guards its weight-sync features."""
    from trl.generation import vllm_client as vc

    if vc.is_vllm_available():
        return vc.VLLMClient(base_url=base_url, connection_timeout=timeout_s)
    import requests

    client = vc.VLLMClient.__new__(vc.VLLMClient)
    client.session = requests.Session()
    client.base_url = base_url.rstrip("/")
    client.host = base_url.split("//")[-1].split(":")[0]
    client.communicator = None
    client.check_server(timeout_s)
    client.model = client._get(f"{client.base_url}/v1/models")["data"][0]["id"]
    return client


def topk_to_logits(logprobs: torch.Tensor, token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(..., K) top-k log-probs (-inf where missing) and their ids -> (..., V) logits whose softmax is those
    probabilities on the top-k tokens and the rest of the mass spread evenly over the other tokens."""
    valid = torch.isfinite(logprobs)
    probs = torch.where(valid, logprobs.exp(), torch.zeros_like(logprobs))
    count = valid.sum(-1, keepdim=True)
    rest = (vocab_size - count).clamp_min(1)
    tail = (1.0 - probs.sum(-1, keepdim=True)).clamp_min(1e-8)
    base = (tail / rest).log()                                          # (..., 1)
    out = base.expand(*logprobs.shape[:-1], vocab_size).clone()
    # padded slots repeat the best entry so the scatter never writes -inf over a real one
    first_ids, first_lps = token_ids[..., :1].expand_as(token_ids), logprobs[..., :1].expand_as(logprobs)
    ids = torch.where(valid, token_ids, first_ids)
    lps = torch.where(valid, logprobs, first_lps)
    has_any = valid.any(-1, keepdim=True)
    lps = torch.where(has_any, lps, base.expand_as(lps))               # no entry at all: leave uniform
    if ids.numel() and int(ids.max()) >= vocab_size:
        raise ValueError(f"the teacher server returned token id {int(ids.max())}, outside the student's vocabulary "
                         f"of {vocab_size}: teacher and student must share a tokenizer")
    return out.scatter(-1, ids, lps)


def truncate_logits(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """A colocated teacher with `top_k`: the same top-k-plus-tail distribution the server path produces."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    values, ids = torch.topk(logp, min(top_k, logp.shape[-1]), dim=-1)
    return topk_to_logits(values, ids, logp.shape[-1]).to(logits.dtype)


class RemoteTeacher(nn.Module):
    """Stands in for the teacher model: `forward` returns top-k-plus-tail logits fetched from the teacher server."""

    def __init__(self, address: str, top_k: int, config: Any, temperature: float = 1.0) -> None:
        super().__init__()
        self.address, self.top_k, self.config, self.temperature = address, top_k, config, temperature
        self.vocab_size = int(config.get_text_config().vocab_size)
        self._client: Any = None
        self.register_buffer("_device_anchor", torch.zeros(0), persistent=False)  # follows .to(device)

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = teacher_client(f"http://{self.address}")
        return self._client

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **_: Any) -> Any:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        mask = attention_mask.bool().cpu()
        ids = input_ids.detach().cpu()
        positions = [m.nonzero(as_tuple=True)[0] for m in mask]
        seqs = [ids[i, pos].tolist() for i, pos in enumerate(positions)]
        scoring = [i for i, s in enumerate(seqs) if len(s) > 1]
        logits = torch.zeros(ids.shape[0], ids.shape[1], self.vocab_size)
        if scoring:
            result = self.client.get_sequence_logprobs(
                sequences=[seqs[i] for i in scoring], prompt_lengths=[1] * len(scoring), top_logprobs=self.top_k,
                temperature=self.temperature)
            for row, i in enumerate(scoring):
                lps = torch.tensor(result["logprobs"][row], dtype=torch.float32).reshape(-1, self.top_k)
                tids = torch.tensor(result["logprob_token_ids"][row], dtype=torch.long).reshape(-1, self.top_k)
                # the entry for sequence token j+1 is the distribution predicted at position j
                logits[i, positions[i][: lps.shape[0]]] = topk_to_logits(lps, tids, self.vocab_size)
        return SimpleNamespace(logits=logits.to(input_ids.device))

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a separate teacher role serves top-k log-probabilities, not generation (seq_kd=True): "
                           "colocate the teacher (colocate_groups: [[train, teacher]]) to generate with it")



class TruncatedTeacher(nn.Module):
    """A colocated teacher asked for `top_k`: its own forward, reduced to the top-k-plus-tail distribution."""

    def __init__(self, inner: nn.Module, top_k: int) -> None:
        super().__init__()
        self.inner, self.top_k = inner, top_k
        self.config = getattr(inner, "config", None)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.inner(*args, **kwargs)
        return SimpleNamespace(logits=truncate_logits(out.logits, self.top_k))

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.generate(*args, **kwargs)
