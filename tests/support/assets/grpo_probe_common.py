"""What the GRPO server probes (grpo_replica_restart_probe.py, grpo_fleet_probe.py) share: the job's config, the
reward, the router's table, and the comparison of a replica's log-probabilities of a fixed prompt with the
trainer's model. Imported from the probe's own directory (a script's folder is on sys.path, as with `python`)."""
import os
import time

import requests
import torch
from trl import GRPOConfig

PROMPT = [2, 10, 11, 12, 13, 14]   # token ids of the tiny model's vocabulary


def config(out: str, steps: int) -> GRPOConfig:
    """The user's own generation seed: TRL's one request a step, its prompts split by the router over the replicas
    in rotation, each prompt seeded 7 by whichever engine serves it."""
    return GRPOConfig(output_dir=os.path.join(out, "grpo"), per_device_train_batch_size=4, max_steps=steps,
                      learning_rate=0.05, logging_steps=1, seed=0, generation_kwargs={"seed": 7}, num_generations=2,
                      max_completion_length=8, report_to="none", use_cpu=True, bf16=False)


def reward(completions, **kwargs):
    return [float(sum(map(ord, str(c))) % 7) for c in completions]   # varies with the text: non-zero advantages


def stats(base: str) -> dict:
    return requests.get(f"{base}/router/stats", timeout=30).json()


def wait_for(base: str, what: str, check, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = stats(base)
        if check(now):
            return now
        time.sleep(0.2)
    raise TimeoutError(f"{what}: not within {timeout:g} s; the router's table: {stats(base)}")


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


def record_generations(trainer, rec: dict) -> None:
    """Each generation call's answer (completions and their log-probabilities) into rec["generations"]."""
    rec["generations"] = []
    client = trainer.vllm_generation.vllm_client
    generate = client.generate

    def recorded_generate(*args, **kwargs):
        answer = generate(*args, **kwargs)
        rec["generations"].append({"completion_ids": answer["completion_ids"], "logprobs": answer["logprobs"]})
        return answer

    client.generate = recorded_generate
