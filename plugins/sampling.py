"""sampling: roles `sampler` (N completions per prompt), `prm` (per-step scores) and `orm` (one score per
completion), written as one JSONL row per completion. Built on the role API (docs/roles.md): a single
controller that runs unchanged on Ray (groups are actors on their roles' devices) and without it (local).

Results do not depend on how prompts are split: each prompt is generated alone with seed `seed + index`,
with one CPU thread per worker, so both backends write the same JSONL for the same seed.
"""
from __future__ import annotations

import importlib
import re
from typing import Any, Callable

import dualrun
from dualrun.methods.plugin import MethodPlugin


class SamplingPlugin(MethodPlugin):
    name = "sampling"
    roles = ("sampler", "prm", "orm")
    required_roles = ("sampler",)
    single_controller = True   # `dualrun launch --backend ray` runs the program once, as the driver


PLUGIN = SamplingPlugin


# -- reward functions ------------------------------------------------------------------------------------
def contains_answer(prompt: Any, completion: str, answer: Any = None, **_: Any) -> float:
    """1.0 when the row's `answer` appears as a word of the completion."""
    return float(answer is not None and str(answer) in completion.split())


def length_penalty(prompt: Any, completion: str, **_: Any) -> float:
    return -float(len(completion.split()))


def step_length(prompt: Any, steps: list[str], **_: Any) -> list[float]:
    """A toy process reward: shorter steps score higher."""
    return [1.0 / (1 + len(s.split())) for s in steps]


REWARD_FUNCTIONS: dict[str, Callable[..., Any]] = {"contains_answer": contains_answer,
                                                   "length_penalty": length_penalty, "step_length": step_length}


def reward_function(name: str) -> Callable[..., Any] | None:
    """A built-in name or `package.module:function`; None when `name` is a model path."""
    if name in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[name]
    if re.fullmatch(r"[\w.]+:\w+", name):
        module, _, fn = name.partition(":")
        return getattr(importlib.import_module(module), fn)
    return None


def split_steps(text: str) -> list[str]:
    """Steps of a completion: its lines, else its sentences."""
    parts = [p.strip() for p in (text.split("\n") if "\n" in text.strip() else re.split(r"(?<=[.?!])\s+", text))]
    return [p for p in parts if p] or [text]


def _torch(threads: int = 1) -> Any:
    import torch

    torch.set_num_threads(threads)  # one thread: bit-identical results whatever runs the worker
    return torch


def _load(path: str, kind: str = "causal") -> tuple[Any, Any, Any]:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    torch = _torch()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cls = AutoModelForCausalLM if kind == "causal" else AutoModelForSequenceClassification
    tok = AutoTokenizer.from_pretrained(path)
    model = cls.from_pretrained(path, dtype=torch.float32).to(device).eval()
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok, model, device


def prompt_text(tok: Any, prompt: Any) -> str:
    if isinstance(prompt, list):  # chat messages
        return tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return str(prompt)


# -- workers ---------------------------------------------------------------------------------------------
@dualrun.worker(group="sampler")
class Sampler:
    """Generates `n` completions per prompt (transformers; vLLM when `engine='vllm'` and installed)."""

    def __init__(self, model: str, n: int = 4, max_new_tokens: int = 16, temperature: float = 1.0,
                 seed: int = 0, engine: str | None = None) -> None:
        self.n, self.max_new_tokens, self.temperature, self.seed = n, max_new_tokens, temperature, seed
        self.vllm = None
        if engine == "vllm":
            try:
                from vllm import LLM

                self.vllm = LLM(model=model, seed=seed)
            except ImportError:
                self.vllm = None
        self.tok, self.model, self.device = _load(model) if self.vllm is None else (None, None, None)

    @dualrun.function(dispatch="slice", collect="flatten")
    def generate(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """rows: {'index', 'prompt', ...}; one output row per completion, the input fields kept."""
        if self.vllm is not None:
            return self._generate_vllm(rows)
        torch = _torch()
        out = []
        for row in rows:
            text = prompt_text(self.tok, row["prompt"])
            ids = self.tok(text, return_tensors="pt", add_special_tokens=False).to(self.device)
            torch.manual_seed(self.seed + int(row["index"]))
            with torch.no_grad():
                gen = self.model.generate(**ids, do_sample=self.temperature > 0, temperature=self.temperature or 1.0,
                                          top_k=0, top_p=1.0, max_new_tokens=self.max_new_tokens,
                                          num_return_sequences=self.n, pad_token_id=self.tok.pad_token_id)
            start = ids["input_ids"].shape[1]
            for j, seq in enumerate(gen):
                completion = self.tok.decode(seq[start:], skip_special_tokens=True).strip()
                out.append({**row, "sample": j, "completion": completion})
        return out

    def _generate_vllm(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        from vllm import SamplingParams

        out = []
        for row in rows:
            params = SamplingParams(n=self.n, temperature=self.temperature, max_tokens=self.max_new_tokens,
                                    seed=self.seed + int(row["index"]))
            prompt = row["prompt"]
            res = (self.vllm.chat(prompt, params) if isinstance(prompt, list) else self.vllm.generate(prompt, params))
            for j, c in enumerate(res[0].outputs):
                out.append({**row, "sample": j, "completion": c.text.strip()})
        return out


@dualrun.worker(group="orm")
class OutcomeScorer:
    """One score per completion: a Python reward function, or a sequence-classification reward model."""

    def __init__(self, reward: str) -> None:
        self.fn = reward_function(reward)
        if self.fn is None:
            self.tok, self.model, self.device = _load(reward, kind="classifier")

    @dualrun.function(dispatch="slice", collect="flatten")
    def score(self, rows: list[dict[str, Any]]) -> list[float]:
        if self.fn is not None:
            extra = lambda r: {k: v for k, v in r.items() if k not in ("prompt", "completion")}  # noqa: E731
            return [round(float(self.fn(r["prompt"], r["completion"], **extra(r))), 6) for r in rows]
        torch = _torch()
        out = []
        for r in rows:
            ids = self.tok(prompt_text(self.tok, r["prompt"]) + r["completion"], return_tensors="pt",
                           add_special_tokens=False).to(self.device)
            with torch.no_grad():
                out.append(round(float(self.model(**ids).logits[0, 0]), 6))
        return out


@dualrun.worker(group="prm")
class ProcessScorer:
    """Per-step scores: a Python function over the steps, or a causal LM's mean log-probability of each step
    given the prompt and the steps before it."""

    def __init__(self, reward: str) -> None:
        self.fn = reward_function(reward)
        if self.fn is None:
            self.tok, self.model, self.device = _load(reward)

    @dualrun.function(dispatch="slice", collect="flatten")
    def score(self, rows: list[dict[str, Any]]) -> list[list[float]]:
        out = []
        for r in rows:
            steps = split_steps(r["completion"])
            scores = self.fn(r["prompt"], steps) if self.fn is not None else self._lm_scores(r["prompt"], steps)
            out.append([round(float(s), 6) for s in scores])
        return out

    def _lm_scores(self, prompt: Any, steps: list[str]) -> list[float]:
        torch = _torch()
        ids = self.tok(prompt_text(self.tok, prompt), add_special_tokens=False)["input_ids"]
        spans = []
        for s in steps:
            piece = self.tok(" " + s, add_special_tokens=False)["input_ids"]
            spans.append((len(ids), len(ids) + len(piece)))
            ids = ids + piece
        x = torch.tensor([ids], device=self.device)
        with torch.no_grad():
            logp = torch.log_softmax(self.model(input_ids=x).logits[0, :-1].float(), dim=-1)
        token_lp = logp.gather(1, x[0, 1:, None])[:, 0]
        return [float(token_lp[a - 1:b - 1].mean()) if b > a else 0.0 for a, b in spans]


# -- the controller --------------------------------------------------------------------------------------
def run_sampling(rows: list[dict[str, Any]], model: str, n: int = 4, max_new_tokens: int = 16,
                 temperature: float = 1.0, seed: int = 0, prm: str | None = None, orm: str | None = None,
                 engine: str | None = None) -> list[dict[str, Any]]:
    """Sample, then score (each scorer only when asked); one dict per completion, in prompt/sample order."""
    rows = [{**r, "index": r.get("index", i)} for i, r in enumerate(rows)]
    sampler = Sampler(model, n, max_new_tokens, temperature, seed, engine)
    samples = sampler.generate(rows)
    scorers = []
    if orm:
        scorers.append(("orm_score", OutcomeScorer(orm).score.submit(samples)))   # both scorers run at once
    if prm:
        scorers.append(("prm_scores", ProcessScorer(prm).score.submit(samples)))
    for key, future in scorers:
        for row, value in zip(samples, future.result()):
            row[key] = value
            if key == "prm_scores":
                row["prm_score"] = min(value) if value else None
    return samples
