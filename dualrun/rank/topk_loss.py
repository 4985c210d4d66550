"""GKD's generalized Jensen-Shannon loss computed from a teacher's top-k log-probabilities, without the vocabulary.

Why: a teacher server returns, per position, the top-k log-probabilities and their token ids. The distribution they
describe (`teacher.topk_to_logits`: the k tokens exactly, the remaining mass spread evenly over the other tokens) has
only k + 1 distinct values per position, so every sum over the vocabulary that TRL's `generalized_jsd_loss` takes
splits into a sum over the k tokens plus (count of the other tokens) x (one value). The teacher side then stays
(batch, sequence, k); only the student's own logits are vocabulary-sized, as they are anyway, and the loss takes
them a chunk of positions at a time, so its temporaries do not grow with the sequence either.

Semantics are TRL 1.16's `GKDTrainer.generalized_jsd_loss`: the same beta cases (0: KL(teacher || student), 1:
KL(student || teacher), else the beta-mixture JSD), temperature on both sides, labels == -100 masked, and the same
reductions (`num_items_in_batch` first, then batchmean / sum / mean). A test compares it with the dense path.
"""
from __future__ import annotations

from typing import Any, Iterator, NamedTuple

import torch

IGNORE_INDEX = -100  # TRL's label for positions outside the loss
MIN_TAIL = 1e-8      # the tail mass floor `topk_to_logits` uses


class TopK(NamedTuple):
    """A teacher's answer per position: (..., K) log-probabilities (-inf where there is no entry) and token ids."""

    logprobs: torch.Tensor
    token_ids: torch.Tensor


def check_token_ids(token_ids: torch.Tensor, vocab_size: int) -> None:
    """Teacher ids outside the student's vocabulary mean the two do not share a tokenizer: say so, once."""
    if token_ids.numel() and int(token_ids.max()) >= vocab_size:
        raise ValueError(f"the teacher server returned token id {int(token_ids.max())}, outside the student's "
                         f"vocabulary of {vocab_size}: teacher and student must share a tokenizer")


class _Teacher(NamedTuple):
    """The top-k-plus-tail distribution after temperature, in log space: the k entries and the one rest value."""

    top: torch.Tensor     # (..., K) log-prob of each entry; 0 where there is none (every use is masked, and a
                          # finite value keeps -inf * 0 = nan out of the student's gradient)
    rest: torch.Tensor    # (...)    log-prob of each token outside the entries
    n_rest: torch.Tensor  # (...)    how many tokens are outside the entries
    valid: torch.Tensor   # (..., K) bool
    ids: torch.Tensor     # (..., K) token ids, 0 where there is no entry (safe to gather)


def _teacher(topk: TopK, vocab_size: int, temperature: float) -> _Teacher:
    valid = torch.isfinite(topk.logprobs)
    ids = torch.where(valid, topk.token_ids, torch.zeros_like(topk.token_ids))
    lps = topk.logprobs
    probs = torch.where(valid, lps.exp(), torch.zeros_like(lps))
    n_rest = (vocab_size - valid.sum(-1)).to(lps.dtype)             # the tokens outside the entries
    tail = (1.0 - probs.sum(-1)).clamp_min(MIN_TAIL)
    base = (tail / n_rest.clamp_min(1)).log()                        # the logit of each rest token
    neg_inf = torch.full_like(lps, float("-inf"))
    z_top = torch.where(valid, lps, neg_inf) / temperature
    z_rest = base / temperature
    rest_mass = torch.where(n_rest > 0, z_rest + n_rest.clamp_min(1).log(), torch.full_like(z_rest, float("-inf")))
    log_z = torch.logsumexp(torch.cat([z_top, rest_mass.unsqueeze(-1)], -1), -1)  # softmax renormalises, as dense
    top = torch.where(valid, z_top - log_z.unsqueeze(-1), torch.zeros_like(z_top))
    return _Teacher(top, z_rest - log_z, n_rest, valid, ids)


def _masked_sum(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, values, torch.zeros_like(values)).sum(-1)


def _plogp(log_p: torch.Tensor) -> torch.Tensor:
    return log_p.exp() * log_p


def _jsd_rows(student_logits: torch.Tensor, topk: TopK, vocab_size: int, beta: float,
              temperature: float) -> torch.Tensor:
    """The divergence per position, in plain autograd ops (each makes a few student-sized temporaries)."""
    t = _teacher(topk, vocab_size, temperature)
    s = torch.log_softmax(student_logits / temperature, dim=-1)
    s_top = s.gather(-1, t.ids)
    has_rest = t.n_rest > 0
    zero = torch.zeros_like(t.rest)
    if beta == 0:  # KL(teacher || student), F.kl_div(student, teacher)
        top = _masked_sum(t.top.exp() * (t.top - s_top), t.valid)
        s_rest = s.sum(-1) - _masked_sum(s_top, t.valid)
        rest = t.rest.exp() * (t.n_rest * t.rest - s_rest)
        return top + torch.where(has_rest, rest, zero)
    if beta == 1:  # KL(student || teacher), F.kl_div(teacher, student)
        p = s.exp()
        p_top = s_top.exp()
        rest = t.rest * (p.sum(-1) - _masked_sum(p_top, t.valid))
        return (p * s).sum(-1) - _masked_sum(p_top * t.top, t.valid) - torch.where(has_rest, rest, zero)
    b = torch.tensor(beta, dtype=s.dtype, device=s.device)
    log_1mb, log_b = torch.log1p(-b), torch.log(b)
    # sum over the vocabulary of M log M for the mixture M = (1-beta) p + beta q: first as if every token held the
    # rest value, then the k entries swapped for their own values
    m_rest = torch.logaddexp(s + log_1mb, (t.rest + log_b).unsqueeze(-1))
    m_rest_top = torch.logaddexp(s_top + log_1mb, (t.rest + log_b).unsqueeze(-1))
    m_top = torch.logaddexp(s_top + log_1mb, t.top + log_b)
    sum_m = _plogp(m_rest).sum(-1) - _masked_sum(_plogp(m_rest_top), t.valid) + _masked_sum(_plogp(m_top), t.valid)
    sum_q = _masked_sum(_plogp(t.top), t.valid) + torch.where(has_rest, t.n_rest * _plogp(t.rest), zero)
    sum_p = _plogp(s).sum(-1)
    return b * sum_q + (1 - b) * sum_p - sum_m


ROW_ELEMENTS = 1 << 22  # positions x vocabulary per chunk: the temporaries of one chunk stay around 16 MB each


class _ChunkedJSD(torch.autograd.Function):
    """`_jsd_rows` a chunk of positions at a time, forward and backward (recomputed per chunk): memory beyond the
    student logits and their gradient is one chunk's temporaries, not several (batch, sequence, vocabulary)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, lps: torch.Tensor, ids: torch.Tensor, vocab_size: int,
                beta: float, temperature: float) -> torch.Tensor:
        ctx.save_for_backward(logits, lps, ids)
        ctx.args = (vocab_size, beta, temperature)
        out = logits.new_empty(logits.shape[:-1], dtype=torch.promote_types(logits.dtype, lps.dtype))
        for b, rows in _chunks(logits):
            out[b, rows] = _jsd_rows(logits[b, rows], TopK(lps[b, rows], ids[b, rows]), *ctx.args)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, lps, ids = ctx.saved_tensors
        grad = torch.zeros_like(logits)
        for b, rows in _chunks(logits):
            with torch.enable_grad():
                x = logits[b, rows].detach().requires_grad_(True)
                values = _jsd_rows(x, TopK(lps[b, rows], ids[b, rows]), *ctx.args)
                (grad[b, rows],) = torch.autograd.grad(values, x, grad_out[b, rows])
        return grad, None, None, None, None, None


def _chunks(logits: torch.Tensor) -> Iterator[tuple[int, slice]]:
    """(batch row, slice of positions) covering a (batch, positions, vocabulary) tensor."""
    step = max(1, ROW_ELEMENTS // max(1, logits.shape[-1]))
    for b in range(logits.shape[0]):
        for start in range(0, logits.shape[1], step):
            yield b, slice(start, start + step)


def topk_jsd_per_position(student_logits: torch.Tensor, topk: TopK, vocab_size: int, beta: float = 0.5,
                          temperature: float = 1.0) -> torch.Tensor:
    """(..., V) student logits and the teacher's top-k -> (...) divergence per position: TRL's per-element
    `jsd` summed over the vocabulary, computed a chunk of positions at a time."""
    lead = student_logits.shape[:-1]
    if len(lead) == 0:
        raise ValueError("student logits need at least one position dimension")
    check_token_ids(torch.where(torch.isfinite(topk.logprobs), topk.token_ids, 0), vocab_size)
    out = _ChunkedJSD.apply(_as_3d(student_logits), _as_3d(topk.logprobs), _as_3d(topk.token_ids), vocab_size, beta,
                            temperature)
    return out.reshape(lead)


def _as_3d(x: torch.Tensor) -> torch.Tensor:
    """(..., positions, last) as (rows, positions, last); a view for the usual (batch, positions, last)."""
    return x.reshape(-1, *x.shape[-2:]) if x.dim() > 2 else x.unsqueeze(0)


def topk_generalized_jsd_loss(student_logits: torch.Tensor, topk: TopK, vocab_size: int,
                              labels: torch.Tensor | None = None, beta: float = 0.5, temperature: float = 1.0,
                              reduction: str = "batchmean", num_items_in_batch: int | torch.Tensor | None = None,
                              ) -> torch.Tensor:
    """TRL's `generalized_jsd_loss(student_logits, teacher_logits, ...)` with the teacher given as top-k."""
    if reduction not in ("batchmean", "sum", "mean") and num_items_in_batch is None:
        raise ValueError(f"reduction={reduction!r} returns a value per vocabulary entry, which the top-k loss does "
                         "not build: use 'batchmean', 'sum' or 'mean'")
    jsd = topk_jsd_per_position(student_logits, topk, vocab_size, beta, temperature)
    mask = None
    if labels is not None:
        mask = labels != IGNORE_INDEX
        jsd = jsd[mask]
    if num_items_in_batch is not None:
        total = jsd.sum()
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch
    if reduction == "batchmean":
        denom = mask.sum().clamp_min(1) if mask is not None else max(jsd.size(0), 1)
        return jsd.sum() / denom
    if reduction == "sum":
        return jsd.sum()
    return jsd.sum() / (jsd.numel() * vocab_size)  # "mean" over every (position, token) element, as dense
