"""A seed for every sampled prompt a trainer sends its rollout server, so the same job samples the same completions
run after run, on either backend, whichever engine replica or machine serves each prompt.

Why: TRL's `VLLMClient.generate` sends a call's prompts in one `/v1/completions` request, with a `seed` only when the
user put one in `generation_kwargs`. Without one, vLLM samples from its engine's global random stream, which every
sampled row of every engine step draws from: what a prompt gets depends on which rows shared its steps (the timing of
requests, the other replicas' share), so two runs of one job part at the first generation. vLLM's per-request seed
gives the request a generator of its own (its `n` completions seeds `seed`..`seed+n-1`), and vLLM's CPU kernels
answer a prompt the same whatever its batch-mates (checked bit for bit: alone, among 7 others, reversed, on 1 and 2
threads, in one process and three).

So when the user set no seed and the call samples (temperature > 0), the prompts of the call go as one request each,
all at once, prompt i of the trainer's call c seeded `prompt_seed(torch.initial_seed(), c, i)` (`torch.initial_seed()`
is the seed the trainer set, `GRPOConfig.seed`; reading it draws nothing). The seed depends on nothing else, so the
router may send each request to any replica. A call made while a Trainer trains is named by its place in the
training, `step<G>/<train|eval>/<n>` (G the trainer state's global step, the n-th such call at it), which a job
resumed from checkpoint-G reaches again: it samples from there on what the uninterrupted job sampled. Outside
training a call is named by its count on the client. A user's `generation_kwargs={"seed": ...}` is
TRL's own request, untouched (vLLM gives each of its prompts that seed), as is greedy generation.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

SEED_BITS = 62     # below int64's top (vLLM's seed field) with room for vLLM's `seed + n - 1`
MAX_IN_FLIGHT = 1024   # requests of one call sent at once: a call's prompts all in flight, as TRL's one request
_INSTALLED = "_dualrun_rollout_seeds"
_CALLS = "_dualrun_generate_calls"


def prompt_seed(base: int, call: int | str, index: int) -> int:
    """The seed of prompt `index` in generation call `call` of a trainer seeded `base` (a hash: stable across
    processes, machines and Python versions; distinct streams for neighbouring calls and prompts)."""
    digest = hashlib.blake2b(f"dualrun-rollout/{base}/{call}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> (64 - SEED_BITS)


def samples(arguments: dict[str, Any]) -> bool:
    """Whether a `generate` call samples: its temperature (which `generation_kwargs` may override) above 0."""
    extra = arguments.get("generation_kwargs") or {}
    temperature = extra.get("temperature", arguments.get("temperature", 1.0))
    return temperature is None or float(temperature) > 0


def needs_seeds(arguments: dict[str, Any]) -> bool:
    """dualrun seeds a call that samples and carries no seed of the user's."""
    return "seed" not in (arguments.get("generation_kwargs") or {}) and samples(arguments)


def merge_answers(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One prompt's answers of `generate`, each a dict of per-row lists, as the answer of one call over all of
    them: each list concatenated in prompt order (None where the server returned none)."""
    merged: dict[str, Any] = {}
    for key in parts[0]:
        values = [part[key] for part in parts]
        merged[key] = None if any(v is None for v in values) else [row for v in values for row in v]
    return merged


def install(module: Any, say: Any = None) -> None:
    """Seed `module.VLLMClient.generate` (trl.generation.vllm_client) per prompt where the user set no seed.
    `say`: called once with a line for the user, at the first call dualrun seeds."""
    cls = module.VLLMClient
    if getattr(cls, _INSTALLED, None) is cls:
        return
    trl_generate = cls.generate
    signature = inspect.signature(trl_generate)
    lock = threading.Lock()
    said: list[bool] = []

    @functools.wraps(trl_generate)
    def generate(self: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        bound = signature.bind(self, *args, **kwargs)
        with lock:
            call = call_name(self)
        if not needs_seeds(bound.arguments):
            return trl_generate(self, *args, **kwargs)
        if say is not None and not said:
            said.append(True)
            say("rollout sampling: each prompt seeded from the trainer's seed, its generation call and its index "
                "(a seed in the trainer config's generation_kwargs sends TRL's one request with that seed instead)")
        return seeded_generate(trl_generate, bound.arguments, call)

    setattr(cls, "generate", generate)
    setattr(cls, _INSTALLED, cls)


_TRAINING: list[Any] = []   # the callback handler that last saw an event, and the state it saw (one trainer a rank)


def follow_training(module: Any) -> None:
    """transformers.trainer_callback: every callback event records the trainer's state and handler, so a generation
    call knows its place in the training (`call_name`)."""
    handler = module.CallbackHandler
    if getattr(handler.call_event, "_dualrun", False):
        return
    original = handler.call_event

    def call_event(self: Any, event: str, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        _TRAINING[:] = [self, state]
        return original(self, event, args, state, control, **kwargs)

    call_event._dualrun = True   # type: ignore[attr-defined]
    handler.call_event = call_event


def place_in_training(training: list[Any]) -> str | None:
    """Pure: `step<G>/<train|eval>` from the handler's model mode and the state's global step (None: no trainer)."""
    if not training:
        return None
    handler, state = training
    model = getattr(handler, "model", None)
    mode = "eval" if model is not None and not getattr(model, "training", True) else "train"
    return f"step{state.global_step}/{mode}"


def global_step() -> int | None:
    """The global step of the trainer this rank trains, as the last callback event saw it (None: none yet)."""
    training = _TRAINING
    step = getattr(training[1], "global_step", None) if len(training) == 2 else None
    return step if isinstance(step, int) else None


def call_name(client: Any) -> int | str:
    """The name of `client`'s next generation call (the caller holds the lock): its place in the training and its
    count there, else its count on the client."""
    place = place_in_training(_TRAINING)
    counts = client.__dict__.setdefault(_CALLS, {})
    n = counts.get(place, 0)
    counts[place] = n + 1
    return n if place is None else f"{place}/{n}"


def seeded_generate(trl_generate: Any, arguments: dict[str, Any], call: int | str) -> dict[str, Any]:
    """TRL's `generate` once per prompt, all at once, each with its own seed; the answers in prompt order."""
    import torch

    base = torch.initial_seed()
    prompts, features = list(arguments["prompts"]), arguments.get("features")
    extra = dict(arguments.get("generation_kwargs") or {})

    def one(index: int) -> dict[str, Any]:
        kwargs = {k: v for k, v in arguments.items() if k != "self"}
        kwargs.update(prompts=[prompts[index]], features=None if features is None else [features[index]],
                      generation_kwargs={**extra, "seed": prompt_seed(base, call, index)})
        return trl_generate(arguments["self"], **kwargs)

    if len(prompts) <= 1:
        return one(0) if prompts else trl_generate(**arguments)
    _widen_pool(arguments["self"], min(len(prompts), MAX_IN_FLIGHT))
    with ThreadPoolExecutor(max_workers=min(len(prompts), MAX_IN_FLIGHT)) as pool:
        return merge_answers(list(pool.map(one, range(len(prompts)))))


def _widen_pool(client: Any, size: int) -> None:
    """Keep a connection per request in flight (TRL's session pools 64): past the pool, urllib3 opens and drops a
    connection per request, with a warning each."""
    session = getattr(client, "session", None)
    if session is None or getattr(client, "_dualrun_pool", 0) >= size:
        return
    from requests.adapters import HTTPAdapter

    for prefix in ("http://", "https://"):
        old = session.get_adapter(prefix)
        session.mount(prefix, HTTPAdapter(max_retries=getattr(old, "max_retries", 0), pool_connections=1,
                                          pool_maxsize=size))
    client._dualrun_pool = size
