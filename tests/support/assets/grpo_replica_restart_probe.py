"""TRL's unchanged GRPOTrainer against 2 vLLM rollout replicas behind dualrun's router, one of them killed and restarted
mid-run (the test kills it; dualrun restarts it). A callback, which only observes and waits, proves what happens:
- at the start of step KILL_AT it asks for the kill (OUT/kill_now holds replica 1's address) and waits until the
  launcher has taken the dead replica out of the weight-transfer group (the router's /router/stats);
- at the start of step KILL_AT + 1 (one sync later, to replica 0 alone) it waits until the restarted replica has
  joined the group again, held out of rotation, and records the router's rows;
- at the start of every step (and at the end) each replica in rotation is compared with the trainer's model as it
  was when the previous step began (the weights that step's sync pushed): log-probabilities of a fixed prompt.

Writes OUT/rank0.json: the checks, the rows seen, the initial log-probabilities, each generation call's answer
(completions and their log-probabilities), the losses.

    grpo_replica_restart_probe.py MODEL PROMPTS.jsonl OUT
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
KILL_AT, STEPS = 2, 5
PROMPT = [2, 10, 11, 12, 13, 14]   # token ids of the tiny model's vocabulary
dataset = load_dataset("json", data_files=data, split="train")
# the user's own generation seed: TRL's one request a step, its 2 prompts split by the router over the replicas in
# rotation, each prompt seeded 7 by whichever engine serves it
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


class RestartProof(TrainerCallback):
    def __init__(self) -> None:
        self.previous = None

    def check(self, step: int) -> None:
        if self.previous is None:
            return
        table = stats()
        for i in table["in_rotation"]:
            row = table["replicas"][i]
            got = logprobs_of(row["address"])
            rec["checks"].append({"step": step, "replica": i, "incarnation": row["incarnation"],
                                  "gap": gap(got, self.previous), "from_initial": gap(got, rec["initial"])})

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        step = state.global_step
        if step == KILL_AT + 2:   # its first sync restored it (in rotation once its probes passed: about 2 s)
            rec["rows"]["restored"] = wait_for("replica 1 back in rotation", lambda t: 1 in t["in_rotation"],
                                               30)["replicas"]
        self.check(step)
        if step == KILL_AT:
            address = stats()["replicas"][1]["address"]
            with open(os.path.join(out, "kill_now"), "w") as f:
                f.write(address)
            rec["rows"]["removed"] = wait_for("replica 1 out of the weight-transfer group",
                                              lambda t: not t["replicas"][1]["member"], 120)["replicas"]
        if step == KILL_AT + 1:
            rec["rows"]["rejoined"] = wait_for(
                "replica 1 restarted and back in the weight-transfer group",
                lambda t: t["replicas"][1]["member"] and t["replicas"][1]["incarnation"] == 1, 600)["replicas"]
        self.previous = trainer_side(model)
        rec.setdefault("initial", self.previous)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.check(state.global_step)


trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=config, train_dataset=dataset,
                      callbacks=[RestartProof()])
rec["generations"] = []
generate = trainer.vllm_generation.vllm_client.generate


def recorded_generate(*args, **kwargs):
    answer = generate(*args, **kwargs)
    rec["generations"].append({"completion_ids": answer["completion_ids"], "logprobs": answer["logprobs"]})
    return answer


trainer.vllm_generation.vllm_client.generate = recorded_generate
trainer.train()
rec["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
rec["final_rows"] = stats()["replicas"]
with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(rec, f)
