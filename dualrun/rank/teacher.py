"""Trainer side of a separate teacher: a module that looks like the teacher model but asks its server.

Why a stand-in module: GKD's trainer calls `self.teacher_model(input_ids=..., attention_mask=...).logits`; replacing
the model by this module moves that forward to the teacher role over the network and leaves the user's script and
TRL's loss semantics untouched. The server returns only the top-k log-probabilities per position (TRL's
`VLLMClient` asks for them): the distribution they describe holds the top-k tokens exactly and spreads the remaining
mass evenly over the other tokens, top-k distillation with a tail, never full vocabulary.

Why a loss of our own: `forward` would have to hand GKD a (batch, sequence, vocabulary) tensor of that distribution
(about 5 GB per rank for a 152k vocabulary, 2k tokens, batch 4). `use_topk_loss` makes GKDTrainer's `compute_loss`
ask `RemoteTeacher.topk` instead and compute the same loss from (batch, sequence, k) tensors (`topk_loss`);
`forward` stays for code that calls the teacher itself (a subclass with its own `compute_loss`).
"""
from __future__ import annotations

import functools
import sys
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from dualrun.rank.topk_loss import TopK, check_token_ids, topk_generalized_jsd_loss


def teacher_client(base_url: str, timeout_s: float = 60.0) -> Any:
    """TRL's `VLLMClient` for `base_url`. Its scoring call needs only HTTP, so where vLLM is not installed (the
    CPU engine) the client is built without the import check that guards its weight-sync features."""
    from trl.generation import vllm_client as vc

    if vc.is_vllm_available():
        return vc.VLLMClient(base_url=base_url, connection_timeout=timeout_s)
    from dualrun.rank.server_auth import session

    client = vc.VLLMClient.__new__(vc.VLLMClient)
    client.session = session()   # the job's headers (the module's `requests` is dualrun's once it is imported)
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
    check_token_ids(ids, vocab_size)
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
        """TRL's client of the teacher server, made on first use; a caller may set one of its own (canned answers)."""
        if self._client is None:
            self._client = teacher_client(f"http://{self.address}")
        return self._client

    @client.setter
    def client(self, value: Any) -> None:
        self._client = value

    def topk(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> TopK:
        """(batch, sequence, k) log-probabilities (-inf where the server sent none: padding, the last token) and
        token ids on `input_ids`' device; the entry at position j is the distribution predicting token j + 1."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        mask = attention_mask.bool().cpu()
        ids = input_ids.detach().cpu()
        positions = [m.nonzero(as_tuple=True)[0] for m in mask]
        seqs = [ids[i, pos].tolist() for i, pos in enumerate(positions)]
        scoring = [i for i, s in enumerate(seqs) if len(s) > 1]
        shape = (ids.shape[0], ids.shape[1], self.top_k)
        logprobs = torch.full(shape, float("-inf"))
        token_ids = torch.zeros(shape, dtype=torch.long)
        if scoring:
            result = self.client.get_sequence_logprobs(
                sequences=[seqs[i] for i in scoring], prompt_lengths=[1] * len(scoring), top_logprobs=self.top_k,
                temperature=self.temperature)
            for row, i in enumerate(scoring):
                lps = torch.tensor(result["logprobs"][row], dtype=torch.float32).reshape(-1, self.top_k)
                tids = torch.tensor(result["logprob_token_ids"][row], dtype=torch.long).reshape(-1, self.top_k)
                logprobs[i, positions[i][: lps.shape[0]]] = lps
                token_ids[i, positions[i][: lps.shape[0]]] = tids
        check_token_ids(torch.where(torch.isfinite(logprobs), token_ids, 0), self.vocab_size)
        return TopK(logprobs.to(input_ids.device), token_ids.to(input_ids.device))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **_: Any) -> Any:
        """The dense (batch, sequence, vocabulary) logits of the top-k-plus-tail distribution (positions without
        an entry: uniform). Only for callers that need a model-like teacher; GKD's own loss uses `topk`."""
        topk = self.topk(input_ids, attention_mask)
        return SimpleNamespace(logits=topk_to_logits(topk.logprobs, topk.token_ids, self.vocab_size))

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a separate teacher role serves top-k log-probabilities, not generation (seq_kd=True): "
                           "colocate the teacher (colocate_groups: [[train, teacher]]) to generate with it")


def remote_teacher(trainer: Any) -> RemoteTeacher | None:
    """The trainer's RemoteTeacher, also when accelerate / DeepSpeed wrapped it (`.module`)."""
    teacher = getattr(trainer, "teacher_model", None)
    for candidate in (teacher, getattr(teacher, "module", None)):
        if isinstance(candidate, RemoteTeacher):
            return candidate
    return None


def use_topk_loss(cls: type) -> None:
    """GKDTrainer's `compute_loss`, when its teacher is a RemoteTeacher: TRL 1.16's steps (student forward, teacher
    in eval mode without gradients, the causal shift, `generalized_jsd_loss` with `beta` and its defaults) with the
    teacher kept as top-k. A trainer class that overrides `generalized_jsd_loss` keeps the dense path, so its own
    loss still sees full logits."""
    if getattr(cls.compute_loss, "_dualrun", False):
        return
    dense_compute_loss = cls.compute_loss
    dense_loss = cls.generalized_jsd_loss
    empty_cache = getattr(sys.modules.get(cls.__module__), "empty_cache", lambda: None)

    @functools.wraps(dense_compute_loss)
    def compute_loss(self: Any, model: Any, inputs: Any, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        teacher = remote_teacher(self)
        if teacher is None or type(self).generalized_jsd_loss is not dense_loss:
            return dense_compute_loss(self, model, inputs, return_outputs, num_items_in_batch)
        student_outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        self.teacher_model.eval()
        with torch.no_grad():
            topk = teacher.topk(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        loss = topk_generalized_jsd_loss(
            student_outputs.logits[:, :-1, :], TopK(topk.logprobs[:, :-1], topk.token_ids[:, :-1]),
            teacher.vocab_size, labels=inputs["labels"][:, 1:], beta=self.beta, num_items_in_batch=num_items_in_batch)
        empty_cache()
        return (loss, student_outputs) if return_outputs else loss

    compute_loss._dualrun = True  # type: ignore[attr-defined]
    cls.compute_loss = compute_loss  # type: ignore[method-assign]


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
