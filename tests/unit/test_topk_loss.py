"""GKD's loss from a teacher's top-k, without a vocabulary-sized teacher tensor, against TRL's dense loss on the
same top-k-plus-tail distribution (`topk_to_logits` + `GKDTrainer.generalized_jsd_loss`): values and gradients
within 1e-5; then GKDTrainer's `compute_loss` with a RemoteTeacher served by the real CPU engine, both ways."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
torch = pytest.importorskip("torch")

from dualrun.rank.teacher import RemoteTeacher, topk_to_logits, use_topk_loss  # noqa: E402
from dualrun.rank.topk_loss import TopK, topk_generalized_jsd_loss  # noqa: E402
from test_servers import engine  # noqa: E402,F401 - a module fixture: the CPU engine in this process

pytestmark = pytest.mark.timeout(120)

B, T, V, K = 3, 7, 64, 6


def _gkd_trainer():
    from trl.experimental.gkd import GKDTrainer

    return GKDTrainer


def _case(seed: int = 0, k: int = K, vocab: int = V):
    """Student logits, a teacher's top-k with padded entries, rows without entries, and labels with -100s."""
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(B, T, vocab, generator=g) * 2
    teacher = torch.log_softmax(torch.randn(B, T, vocab, generator=g) * 3, -1)
    lps, ids = torch.topk(teacher, k, -1)
    lps[0, 1, k // 2:] = float("-inf")   # fewer entries than k (the server pads with -inf)
    lps[1, 2, :] = float("-inf")         # no entry at all: uniform
    lps[2, 0, :] = float("-inf")
    labels = torch.randint(0, vocab, (B, T), generator=g)
    labels[0, :2] = -100
    labels[2, 5:] = -100
    return student, TopK(lps, ids), labels


def _both(student, topk, vocab, **kw):
    """(dense loss, its gradient), (top-k loss, its gradient) on the same student logits."""
    out = []
    for dense in (True, False):
        x = student.clone().requires_grad_(True)
        if dense:
            loss = _gkd_trainer().generalized_jsd_loss(x, topk_to_logits(topk.logprobs, topk.token_ids, vocab), **kw)
        else:
            loss = topk_generalized_jsd_loss(x, topk, vocab, **kw)
        loss.backward()
        out.append((loss.detach(), x.grad))
    return out


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean"])
def test_equals_the_dense_loss(beta, temperature, reduction):
    student, topk, labels = _case()
    for kw in ({"labels": labels}, {}, {"labels": labels, "num_items_in_batch": torch.tensor(11)}):
        (dense, dense_grad), (sparse, sparse_grad) = _both(student, topk, V, beta=beta, temperature=temperature,
                                                           reduction=reduction, **kw)
        assert sparse.item() == pytest.approx(dense.item(), abs=1e-5, rel=1e-5), kw
        assert torch.allclose(sparse_grad, dense_grad, atol=1e-6), kw
        assert dense.item() > 0


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_many_small_chunks_give_the_same_loss_and_gradient(monkeypatch, beta):
    """The loss runs a chunk of positions at a time (forward, and backward by recomputing each chunk)."""
    from dualrun.rank import topk_loss

    monkeypatch.setattr(topk_loss, "ROW_ELEMENTS", 2 * V)  # 2 positions per chunk: 4 chunks per row of 7
    student, topk, labels = _case(seed=3)
    (dense, dense_grad), (sparse, sparse_grad) = _both(student, topk, V, labels=labels, beta=beta)
    assert sparse.item() == pytest.approx(dense.item(), abs=1e-5)
    assert torch.allclose(sparse_grad, dense_grad, atol=1e-6)
    flat = topk_loss.topk_jsd_per_position(student[0], TopK(topk.logprobs[0], topk.token_ids[0]), V, beta)
    assert flat.shape == (T,)  # one position dimension works too


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_top_k_covering_the_vocabulary_and_a_clamped_tail(beta):
    """k == vocabulary (no token outside the entries) and entries whose mass reaches 1 (the 1e-8 tail floor)."""
    student, topk, labels = _case(seed=1, k=16, vocab=16)
    (dense, dense_grad), (sparse, sparse_grad) = _both(student, topk, 16, labels=labels, beta=beta)
    assert sparse.item() == pytest.approx(dense.item(), abs=1e-5)
    assert torch.allclose(sparse_grad, dense_grad, atol=1e-6)
    student, (lps, ids), labels = _case(seed=2)
    lps = torch.log_softmax(lps.nan_to_num(neginf=-30.0), -1)  # the k entries hold all the mass
    (dense, _), (sparse, _) = _both(student, TopK(lps, ids), V, labels=labels, beta=beta)
    assert sparse.item() == pytest.approx(dense.item(), abs=1e-5)


def test_refuses_a_per_element_reduction_and_foreign_token_ids():
    student, topk, labels = _case()
    with pytest.raises(ValueError, match="per vocabulary entry"):
        topk_generalized_jsd_loss(student, topk, V, labels=labels, reduction="none")
    with pytest.raises(ValueError, match="share a tokenizer"):
        topk_generalized_jsd_loss(student, TopK(topk.logprobs, topk.token_ids + V), V)


# -- GKDTrainer.compute_loss with a RemoteTeacher on the CPU engine -----------------------------------------------
@pytest.fixture(scope="module")
def batch(tiny):  # noqa: F811
    """A GKD batch from TRL's own collator: padding, prompt labels masked with -100."""
    import json

    from transformers import AutoTokenizer
    from trl.experimental.utils import DataCollatorForChatML

    tok = AutoTokenizer.from_pretrained(str(tiny / "model"))
    rows = [json.loads(line) for line in (tiny / "data" / "gkd.jsonl").read_text().splitlines()[:3]]
    return DataCollatorForChatML(tokenizer=tok, max_length=64)(rows)


def _trainer_class(**members):
    cls = type("Probe", (_gkd_trainer(),), dict(members))
    use_topk_loss(cls)
    return cls


def _loss_and_grad(cls, teacher, student, batch, beta=0.5, num_items=None):
    trainer = cls.__new__(cls)
    trainer.teacher_model, trainer.beta = teacher, beta
    student.zero_grad()
    loss, outputs = cls.compute_loss(trainer, student, dict(batch), return_outputs=True,
                                     num_items_in_batch=num_items)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in student.parameters() if p.grad is not None])
    return loss.item(), grads, outputs


@pytest.fixture(scope="module")
def student(tiny):  # noqa: F811
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny / "model"))


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_compute_loss_from_top_k_equals_the_dense_trainer(engine, tiny, batch, student, beta):  # noqa: F811
    """The patched compute_loss never asks the teacher for logits, and gives TRL's dense loss and gradients."""
    from transformers import AutoConfig

    _, address = engine
    teacher = RemoteTeacher(address, 4, AutoConfig.from_pretrained(str(tiny / "teacher")))
    dense_loss, dense_grads, _ = _loss_and_grad(_gkd_trainer(), teacher, student, batch, beta)

    calls = []
    teacher.forward = lambda *a, **k: calls.append(1)  # the top-k path must not build the dense tensor
    cls = _trainer_class()
    loss, grads, outputs = _loss_and_grad(cls, teacher, student, batch, beta)
    assert not calls and outputs.logits.shape[-1] == teacher.vocab_size
    assert loss == pytest.approx(dense_loss, abs=1e-5) and dense_loss > 0
    assert torch.allclose(grads, dense_grads, atol=1e-5)
    loss_n, _, _ = _loss_and_grad(cls, teacher, student, batch, beta, num_items=torch.tensor(5))
    assert loss_n == pytest.approx(loss * int((batch["labels"][:, 1:] != -100).sum()) / 5, rel=1e-5)

    topk = teacher.topk(batch["input_ids"], batch["attention_mask"])
    assert topk.logprobs.shape == (*batch["input_ids"].shape, 4)  # batch x sequence x k, not the vocabulary


def test_a_trainer_with_its_own_loss_keeps_the_dense_path(engine, tiny, batch, student):  # noqa: F811
    from transformers import AutoConfig

    _, address = engine
    teacher = RemoteTeacher(address, 4, AutoConfig.from_pretrained(str(tiny / "teacher")))
    seen = []

    def own_loss(student_logits, teacher_logits, **kw):
        seen.append(teacher_logits.shape[-1])
        return _gkd_trainer().generalized_jsd_loss(student_logits, teacher_logits, **kw)

    own = type("Own", (_trainer_class(),), {"generalized_jsd_loss": staticmethod(own_loss)})  # a user's subclass
    loss, _, _ = _loss_and_grad(own, teacher, student, batch)
    assert seen == [teacher.vocab_size] and loss > 0
