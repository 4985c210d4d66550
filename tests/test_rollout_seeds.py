"""The seed dualrun gives each sampled rollout prompt (dualrun/rank/rollout_seeds.py): what it depends on and when it
applies. Against real engines: test_router.py (CPU engines, one and behind the router), the vLLM tier (GRPO runs
equal bit for bit across runs, backends and replica counts)."""
from __future__ import annotations

import pytest

from dualrun.rank import rollout_seeds
from dualrun.rank.rollout_seeds import merge_answers, needs_seeds, prompt_seed

pytestmark = pytest.mark.timeout(240)


def test_a_prompts_seed_depends_on_the_trainers_seed_the_call_and_the_index_only():
    seeds = {(b, c, i): prompt_seed(b, c, i) for b in (0, 42) for c in range(4) for i in range(64)}
    assert len(set(seeds.values())) == len(seeds)                       # distinct streams
    assert all(0 <= s < 2 ** rollout_seeds.SEED_BITS for s in seeds.values())
    assert 2 ** rollout_seeds.SEED_BITS + 1024 < 2 ** 63               # vLLM's seed + n - 1 stays an int64
    assert prompt_seed(42, 3, 7) == 4416800574368551811   # pinned: a change re-seeds every job (no salted hash())


def test_only_calls_that_sample_without_a_users_seed_are_seeded():
    assert needs_seeds({"prompts": [[1]]})                                      # TRL's default temperature 1.0
    assert needs_seeds({"temperature": 0.7, "generation_kwargs": {"top_k": 5}})
    assert not needs_seeds({"temperature": 0.0})                                # greedy
    assert not needs_seeds({"temperature": 1.0, "generation_kwargs": {"temperature": 0}})   # TRL: kwargs win
    assert not needs_seeds({"generation_kwargs": {"seed": 7}})                  # the user's seed: TRL's request
    assert not needs_seeds({"generation_kwargs": {"seed": None}})               # named by the user: theirs


def test_answers_are_merged_in_prompt_order():
    parts = [{"prompt_ids": [[1]], "completion_ids": [[5], [6]], "logprobs": [[[-1.0]], [[-2.0]]],
              "logprob_token_ids": None},
             {"prompt_ids": [[2, 3]], "completion_ids": [[7], [8]], "logprobs": [[[-3.0]], [[-4.0]]],
              "logprob_token_ids": [[[7]], [[8]]]}]
    assert merge_answers(parts) == {"prompt_ids": [[1], [2, 3]], "completion_ids": [[5], [6], [7], [8]],
                                    "logprobs": [[[-1.0]], [[-2.0]], [[-3.0]], [[-4.0]]], "logprob_token_ids": None}
