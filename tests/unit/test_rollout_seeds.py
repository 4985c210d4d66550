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


def _events(client, handler, state, steps):
    """The trainer's loop as the callbacks see it: each step begins at its global step, then one generation call
    on `client`; the calls' names."""
    from transformers import TrainingArguments
    from transformers.trainer_callback import TrainerControl

    args, names = TrainingArguments(output_dir="unused", report_to="none", use_cpu=True), []
    for step in steps:
        state.global_step = step
        handler.on_step_begin(args, state, TrainerControl())
        names.append(rollout_seeds.call_name(client))
    return names


def _client():
    return type("Client", (), {})()


def test_a_job_resumed_from_a_checkpoint_names_its_calls_as_the_uninterrupted_job_did(monkeypatch):
    """Calls made while a Trainer trains are named by the global step they generate at, not by a count that a
    restarted process begins again at 0: a job resumed at step 2 seeds what the uninterrupted one seeded there."""
    import torch
    from transformers import trainer_callback
    from transformers.trainer_callback import CallbackHandler, TrainerState

    monkeypatch.setattr(CallbackHandler, "call_event", CallbackHandler.call_event)   # restored after the test
    monkeypatch.setattr(rollout_seeds, "_TRAINING", [])
    rollout_seeds.follow_training(trainer_callback)
    model = torch.nn.Linear(1, 1)

    def handler():
        return CallbackHandler([], model, None, None, None)

    uninterrupted = _events(_client(), handler(), TrainerState(), range(4))
    # the restarted process: a fresh client, the checkpoint's state
    resumed = _events(_client(), handler(), TrainerState(global_step=2), range(2, 4))
    assert uninterrupted == ["step0/train/0", "step1/train/0", "step2/train/0", "step3/train/0"]
    assert resumed == uninterrupted[2:]
    model.eval()   # an evaluation at a step names its calls apart from the step's training calls
    client = _client()
    assert _events(client, handler(), TrainerState(), [3]) == ["step3/eval/0"]
    assert rollout_seeds.call_name(client) == "step3/eval/1"
    assert rollout_seeds.global_step() == 3   # what the trainer's requests to the job's servers carry (server_auth)


def test_the_step_the_trainers_requests_carry_is_none_until_a_trainer_trains(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(rollout_seeds, "_TRAINING", [])
    assert rollout_seeds.global_step() is None
    monkeypatch.setattr(rollout_seeds, "_TRAINING", [object(), SimpleNamespace(global_step=7)])
    assert rollout_seeds.global_step() == 7


def test_outside_training_a_call_is_named_by_its_count():
    assert rollout_seeds.place_in_training([]) is None
    client = _client()
    names = []
    for _ in range(3):
        names.append(rollout_seeds.call_name(client))
    assert names == [0, 1, 2] and prompt_seed(0, 1, 0) != prompt_seed(0, "step1/train/0", 0)
