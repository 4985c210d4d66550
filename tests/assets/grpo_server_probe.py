"""Unchanged TRL trainers against a rollout server they never name (dualrun fills the address), on CPU:
1. TRL's AsyncGRPOTrainer: records the `vllm_server_base_url` it got, asks the server through TRL's async client
   (dtype and world size over the dev-mode endpoints), then builds the trainer (on a CPU TRL 1.16 stops there: it
   reads the CUDA device's name for its FLOPs metric).
2. TRL's GRPOTrainer in server mode, trained for 4 steps: the weights go to the server(s) before every generation
   (over gloo on vLLM's CPU build). A callback, which only observes, proves each sync landed: at the start of step
   g (and at the end) every replica's log-probabilities of a fixed prompt, and its greedy completion, are compared
   with the trainer model's as it was when step g-1 began (the weights the sync of step g-1 pushed).

Writes out/rank0.json: filled fields, losses, and per check the largest log-probability difference per replica,
the greedy completions, and how far the trainer's weights moved since the previous check; then the same after one
tensor pushed alone through TRL's `update_named_param`.

    grpo_server_probe.py MODEL PROMPTS.jsonl OUT
"""
import json
import os
import sys

import requests
import torch
from datasets import load_dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from trl.experimental.async_grpo.vllm_client import VLLMClient

model, data, out = sys.argv[1:4]
path = os.path.join(out, f"rank{os.environ['RANK']}.json")
dataset = load_dataset("json", data_files=data, split="train")
PROMPT = [2, 10, 11, 12, 13, 14]   # token ids of the tiny model's vocabulary
GREEDY_TOKENS = 6


def reward(completions, **kwargs):
    return [float(sum(map(ord, str(c))) % 7) for c in completions]   # varies with the text: non-zero advantages


common = dict(num_generations=2, max_completion_length=8, report_to="none", use_cpu=True, bf16=False)
rec = {}
async_config = AsyncGRPOConfig(output_dir=os.path.join(out, "async"), dtype="float32", vllm_server_timeout=60,
                               max_steps=1, **common)
rec["async_url"] = async_config.vllm_server_base_url
client = VLLMClient(async_config.vllm_server_base_url, server_timeout=60)
client.wait_for_server_ready()
rec["async_server"] = {"dtype": client.get_dtype(), "world_size": client.get_world_size()}
try:
    AsyncGRPOTrainer(model=model, reward_funcs=[reward], args=async_config, train_dataset=dataset)
    rec["async_error"] = None
except Exception as e:  # noqa: BLE001 - recorded for the test
    rec["async_error"] = f"{type(e).__name__}: {e}"

config = GRPOConfig(output_dir=os.path.join(out, "grpo"), per_device_train_batch_size=2, max_steps=4,
                    learning_rate=0.05, logging_steps=1, seed=0, generation_kwargs={"seed": 7}, **common)
rec["grpo"] = {k: getattr(config, k) for k in ("use_vllm", "vllm_mode", "vllm_server_host", "vllm_server_port",
                                               "vllm_group_port")}
base = f"http://{config.vllm_server_host}:{config.vllm_server_port}"


def replicas() -> list[str]:
    """Each engine: the router's replicas (dualrun's /router/stats), or the one server."""
    stats = requests.get(f"{base}/router/stats", timeout=30)
    return [f"http://{r['address']}" for r in stats.json()["replicas"]] if stats.status_code == 200 else [base]


def served(url: str) -> dict:
    name = requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": name, "prompt": PROMPT, "max_tokens": GREEDY_TOKENS, "temperature": 0, "prompt_logprobs": 0,
            "return_token_ids": True}
    choice = requests.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    logprobs = [None if d is None else d[str(t)]["logprob"] for d, t in zip(choice["prompt_logprobs"], PROMPT)]
    return {"logprobs": logprobs, "greedy": choice["token_ids"]}


@torch.no_grad()
def trainer_side(m) -> dict:
    was_training = m.training
    m.eval()
    ids = torch.tensor([PROMPT])
    lp = torch.log_softmax(m(ids).logits[0, :-1].float(), -1)
    greedy = m.generate(ids, max_new_tokens=GREEDY_TOKENS, do_sample=False, min_new_tokens=GREEDY_TOKENS)
    m.train(was_training)
    return {"logprobs": [None] + [lp[i, t].item() for i, t in enumerate(PROMPT[1:])],
            "greedy": greedy[0, len(PROMPT):].tolist()}


def gap(a: list, b: list) -> float:
    return max(abs(x - y) for x, y in zip(a[1:], b[1:]))


class SyncProof(TrainerCallback):
    """Observes only: the servers' answers against the trainer's model, one step behind (see the docstring)."""

    def __init__(self) -> None:
        self.previous = None
        rec["checks"] = []
        rec["initial_greedy"] = [served(url)["greedy"] for url in replicas()]

    def check(self, step: int) -> None:
        if self.previous is None:
            return
        answers = [served(url) for url in replicas()]
        rec["checks"].append({"step": step, "logprob_gap": [gap(a["logprobs"], self.previous["logprobs"])
                                                            for a in answers],
                              "greedy": [a["greedy"] for a in answers], "trainer_greedy": self.previous["greedy"],
                              "moved": self.previous.get("moved")})

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.check(state.global_step)
        now = trainer_side(model)
        if self.previous is not None:
            now["moved"] = gap(now["logprobs"], self.previous["logprobs"])
        self.previous = now

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.check(state.global_step)


trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=config, train_dataset=dataset,
                      callbacks=[SyncProof()])
trainer.train()
# TRL's per-tensor call (`update_named_param`, one tensor in its own update) on the same client: one weight changed
client = trainer.vllm_generation.vllm_client
trainer.vllm_generation.sync_weights()   # first the last step's update, which no generation followed (TRL's sync)
before = trainer_side(trainer.model)
with torch.no_grad():
    trainer.model.model.norm.weight.mul_(3.0)
client.update_named_param("model.norm.weight", trainer.model.model.norm.weight.data)
client.reset_prefix_cache()
after = trainer_side(trainer.model)
rec["one_tensor"] = {"moved": gap(after["logprobs"], before["logprobs"]),
                     "logprob_gap": [gap(served(url)["logprobs"], after["logprobs"]) for url in replicas()]}
rec["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
rec["rewards"] = [h["reward"] for h in trainer.state.log_history if "reward" in h]
with open(path, "w") as f:
    json.dump(rec, f)
