"""TRL's unchanged GRPOTrainer against a vLLM rollout fleet that grows from 1 to 2 replicas and back while it trains
(the test runs `dualrun scale`; dualrun starts and stops the replica). A callback, which only observes and waits:
- at the start of step GROW_AT it asks for the growth (OUT/grow_now) and waits until the new replica has joined the
  weight-transfer group, held out of rotation (it takes the trainer's weights at this step's sync);
- at the start of step SHRINK_AT it asks for the shrink (OUT/shrink_now) and waits until the replica has left;
- at the start of every step (and at the end) each replica in rotation is compared with the trainer's model as it
  was when the previous step began (the weights that step's sync pushed): log-probabilities of a fixed prompt.
With --fixed it asks for nothing: the same job on a fleet of one.

Writes OUT/rank0.json: the checks, the rows seen, each generation call's answer, the losses.

    grpo_fleet_probe.py MODEL PROMPTS.jsonl OUT [--fixed]
"""
import json
import os
import sys
import time

import requests
import torch
from datasets import load_dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

model, data, out = sys.argv[1:4]
FIXED = "--fixed" in sys.argv[4:]
GROW_AT, SHRINK_AT, STEPS = 1, 3, 5
PROMPT = [2, 10, 11, 12, 13, 14]   # token ids of the tiny model's vocabulary
dataset = load_dataset("json", data_files=data, split="train")
# the user's own generation seed: each prompt seeded 7 by whichever engine serves it, however many share the step
config = GRPOConfig(output_dir=os.path.join(out, "grpo"), per_device_train_batch_size=4, max_steps=STEPS,
                    learning_rate=0.05, logging_steps=1, seed=0, generation_kwargs={"seed": 7}, num_generations=2,
                    max_completion_length=8, report_to="none", use_cpu=True, bf16=False)
base = f"http://{config.vllm_server_host}:{config.vllm_server_port}"
rec = {"checks": [], "rows": {}}


def reward(completions, **kwargs):
    return [float(sum(map(ord, str(c))) % 7) for c in completions]   # varies with the text: non-zero advantages


def stats() -> dict:
    return requests.get(f"{base}/router/stats", timeout=30).json()


def wait_for(what: str, check, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = stats()
        if check(now):
            return now
        time.sleep(0.2)
    raise TimeoutError(f"{what}: not within {timeout:g} s; the router's table: {stats()}")


def logprobs_of(address: str) -> list:
    body = {"model": requests.get(f"http://{address}/v1/models", timeout=30).json()["data"][0]["id"],
            "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
    choice = requests.post(f"http://{address}/v1/completions", json=body, timeout=60).json()["choices"][0]
    return [None if d is None else d[str(t)]["logprob"] for d, t in zip(choice["prompt_logprobs"], PROMPT)]


@torch.no_grad()
def trainer_side(m) -> list:
    was_training = m.training
    m.eval()
    lp = torch.log_softmax(m(torch.tensor([PROMPT])).logits[0, :-1].float(), -1)
    m.train(was_training)
    return [None] + [lp[i, t].item() for i, t in enumerate(PROMPT[1:])]


def gap(a: list, b: list) -> float:
    return max(abs(x - y) for x, y in zip(a[1:], b[1:]))


class FleetProof(TrainerCallback):
    def __init__(self) -> None:
        self.previous = None

    def check(self, step: int) -> None:
        if self.previous is None:
            return
        table = stats()
        for i in table["in_rotation"]:
            got = logprobs_of(table["replicas"][i]["address"])
            rec["checks"].append({"step": step, "replica": i, "gap": gap(got, self.previous)})

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        step = state.global_step
        self.check(step)
        if not FIXED and step == GROW_AT:
            open(os.path.join(out, "grow_now"), "w").close()
            rec["rows"]["joined"] = wait_for("replica 1 in the weight-transfer group, held",
                                             lambda t: t["replicas"][1]["member"], 300)["replicas"]
        if not FIXED and step == SHRINK_AT:
            open(os.path.join(out, "shrink_now"), "w").close()
            rec["rows"]["left"] = wait_for("replica 1 out of the weight-transfer group",
                                           lambda t: not t["replicas"][1]["member"], 120)["replicas"]
        self.previous = trainer_side(model)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.check(state.global_step)


trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=config, train_dataset=dataset,
                      callbacks=[FleetProof()])
rec["generations"] = []
generate = trainer.vllm_generation.vllm_client.generate


def recorded_generate(*args, **kwargs):
    answer = generate(*args, **kwargs)
    rec["generations"].append({"completion_ids": answer["completion_ids"], "logprobs": answer["logprobs"]})
    return answer


trainer.vllm_generation.vllm_client.generate = recorded_generate
trainer.train()
rec["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(rec, f)
