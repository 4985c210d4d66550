"""Unchanged TRL trainers against a rollout server they never name (dualrun fills the address), on CPU:
1. TRL's AsyncGRPOTrainer: records the `vllm_server_base_url` it got, asks the server through TRL's async client
   (dtype and world size over the dev-mode endpoints), then builds the trainer (on a CPU TRL 1.16 stops there: it
   reads the CUDA device's name for its FLOPs metric); then the weight transfer the trainer would build (gloo,
   through dualrun's hook) syncs a perturbed and then the original model into the server(s), each sync checked.
2. TRL's GRPOTrainer in server mode, trained for 4 steps: the weights go to the server(s) before every generation
   (over gloo on vLLM's CPU build). A callback, which only observes, proves each sync landed: at the start of step
   g (and at the end) every replica's log-probabilities of a fixed prompt, and its greedy completion, are compared
   with the trainer model's as it was when step g-1 began (the weights the sync of step g-1 pushed).

Writes out/rank0.json: filled fields, losses, rewards, each generation call's answer (prompts, completions, their
tokens' log-probabilities: sampled with dualrun's per-prompt seeds, the script sets none), and per check the largest
log-probability difference per replica, the greedy completions, and how far the trainer's weights moved since the
previous check; then the same after one tensor pushed alone through TRL's `update_named_param`.

For the restart test (`--restart_test`): AsyncGRPOTrainer only in the restarted attempt, a checkpoint every step,
and on the first attempt the trainer waits at the start of step `--hold_at_step` (its checkpoint written) while
`--hold_file` exists, so the test kills a replica there; the restarted attempt resumes from that checkpoint
(dualrun's resume hook) and records which attempt it is, the step it resumed at and each fresh replica's
log-probabilities before any sync.

With `--teacher TEACHER` the trainer is TRL's DistillationTrainer instead of GRPOTrainer (on-policy: the student
generates through the same server, after the same weight sync), distilling from TEACHER loaded in the trainer.

With several trainer ranks only rank 0 observes, records and checks (TRL's vLLM client is rank 0's alone), and the
AsyncGRPOTrainer part (1.) is left out.

    grpo_server_probe.py MODEL PROMPTS.jsonl OUT [--restart_test --max_steps N --hold_file F --hold_at_step S]
                                                 [--teacher TEACHER]
"""
import argparse
import functools
import json
import os
import time

import requests
import torch
from datasets import load_dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from trl.experimental.async_grpo.vllm_client import VLLMClient

cli = argparse.ArgumentParser()
cli.add_argument("model")
cli.add_argument("data")
cli.add_argument("out")
cli.add_argument("--restart_test", action="store_true")
cli.add_argument("--max_steps", type=int, default=4)
cli.add_argument("--hold_file", default="")
cli.add_argument("--hold_at_step", type=int, default=2)
cli.add_argument("--teacher", default="")
a = cli.parse_args()
model, data, out = a.model, a.data, a.out
attempt = sum(int(os.environ.get(k, "0")) for k in ("TORCHELASTIC_RESTART_COUNT", "DUALRUN_JOB_RESTARTS"))
path = os.path.join(out, f"rank{os.environ['RANK']}.json")
dataset = load_dataset("json", data_files=data, split="train")
PROMPT = [2, 10, 11, 12, 13, 14]   # token ids of the tiny model's vocabulary
GREEDY_TOKENS = 6


def reward(completions, **kwargs):
    return [float(sum(map(ord, str(c))) % 7) for c in completions]   # varies with the text: non-zero advantages


common = dict(num_generations=2, max_completion_length=8, report_to="none", use_cpu=True, bf16=False)
rec = {"attempt": attempt}
saving = dict(save_strategy="steps", save_steps=1) if a.restart_test else dict(save_strategy="no")
# no generation seed: dualrun seeds each prompt (2 a call) from `seed`, so runs can be compared bit for bit
training = dict(per_device_train_batch_size=4, max_steps=a.max_steps, learning_rate=0.05, logging_steps=1, seed=0,
                **saving)
if a.teacher:
    from trl import DistillationConfig, DistillationTrainer

    common.pop("num_generations")
    config = DistillationConfig(output_dir=os.path.join(out, "distil"), **training, **common)
    make_trainer = functools.partial(DistillationTrainer, teacher_model=a.teacher)
else:
    config = GRPOConfig(output_dir=os.path.join(out, "grpo"), **training, **common)
    make_trainer = functools.partial(GRPOTrainer, reward_funcs=[reward])
rec["grpo"] = {k: getattr(config, k) for k in ("use_vllm", "vllm_mode", "vllm_server_host", "vllm_server_port",
                                               "vllm_group_port")}
base = f"http://{config.vllm_server_host}:{config.vllm_server_port}"


def replicas() -> list[str]:
    """Each engine: the router's replicas (dualrun's /router/stats), or the one server."""
    stats = requests.get(f"{base}/router/stats", timeout=30)
    return [f"http://{r['address']}" for r in stats.json()["replicas"]] if stats.status_code == 200 else [base]


def served(url: str) -> dict:
    name = requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": name, "prompt": PROMPT, "max_tokens": GREEDY_TOKENS, "min_tokens": GREEDY_TOKENS,  # as the
            "temperature": 0, "prompt_logprobs": 0, "return_token_ids": True}   # trainer's: no early end of text
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
        initial = [served(url) for url in replicas()]   # before any sync: the weights each engine loaded
        rec["initial_greedy"] = [i["greedy"] for i in initial]
        rec["initial_logprobs"] = [i["logprobs"] for i in initial]

    def check(self, step: int) -> None:
        if self.previous is None:
            return
        answers = [served(url) for url in replicas()]
        rec["checks"].append({"step": step, "logprob_gap": [gap(a["logprobs"], self.previous["logprobs"])
                                                            for a in answers],
                              "greedy": [a["greedy"] for a in answers], "trainer_greedy": self.previous["greedy"],
                              "moved": self.previous.get("moved")})

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if a.hold_file and attempt == 0 and state.global_step == a.hold_at_step:
            open(f"{a.hold_file}.held", "w").close()   # checkpoint-<step> is written: the test kills a replica
            while os.path.exists(a.hold_file):
                time.sleep(0.1)
        self.check(state.global_step)
        now = trainer_side(model)
        if self.previous is None:   # the first step of this attempt (after a restart: the one it resumed at)
            rec["start_step"], rec["start_logprobs"] = state.global_step, now["logprobs"]
        else:
            now["moved"] = gap(now["logprobs"], self.previous["logprobs"])
        self.previous = now

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.check(state.global_step)


def async_grpo() -> None:
    """AsyncGRPOTrainer as far as TRL 1.16 lets it go on a CPU (its constructor stops at the CUDA device), then its
    default weight transfer as the trainer builds it (the module's `WeightTransferClient`, given the trainer's weight
    manifest): two syncs through pause/send_weights/resume, a perturbed model and then the original one, each checked
    against every replica's log-probabilities."""
    from transformers import AutoModelForCausalLM
    from trl.experimental.async_grpo import async_grpo_trainer

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
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    params = lambda: ((n, p.detach()) for n, p in async_grpo_trainer._iter_vllm_named_params(policy))  # noqa: E731
    manifest = list(params())
    info = {"names": [n for n, _ in manifest], "dtype_names": [str(t.dtype).split(".")[-1] for _, t in manifest],
            "shapes": [list(t.shape) for _, t in manifest]}
    transfer = async_grpo_trainer.WeightTransferClient(vllm_client=client, weight_update_info=info,
                                                       weight_sync_timeout=120)
    rec["async_transfer"], rec["async_syncs"] = type(transfer).__name__, []
    transfer.init_weight_transfer()
    original = trainer_side(policy)
    noise = torch.Generator().manual_seed(0)
    saved = {n: t.clone() for n, t in manifest}
    for step in ("perturbed", "restored"):
        with torch.no_grad():
            for n, t in params():
                t.copy_(saved[n] + 0.05 * torch.randn(t.shape, generator=noise) if step == "perturbed" else saved[n])
        now = trainer_side(policy)
        transfer.pause()
        transfer.send_weights(params())
        transfer.resume()
        rec["async_syncs"].append({"step": step, "moved": gap(now["logprobs"], original["logprobs"]),
                                   "logprob_gap": [gap(served(url)["logprobs"], now["logprobs"])
                                                   for url in replicas()]})
    transfer.destroy()


# several trainer ranks: only rank 0 holds TRL's vLLM client, so only it observes, records and checks
alone = os.environ.get("WORLD_SIZE", "1") == "1"
main = os.environ.get("RANK", "0") == "0"
if alone and not a.teacher and (not a.restart_test or attempt > 0):   # restarted: into the fresh engines, before
    async_grpo()                                                        # the resume
trainer = make_trainer(model=model, args=config, train_dataset=dataset, callbacks=[SyncProof()] if main else [])
if not main:
    trainer.train()
    trainer.vllm_generation.sync_weights()   # as rank 0 does below (no collective without ZeRO-3 / FSDP)
    raise SystemExit(0)
rec["generations"] = []   # each generation call's answer: the completions and their sampled tokens' logprobs
generate = trainer.vllm_generation.vllm_client.generate


def recorded_generate(*args, **kwargs):
    answer = generate(*args, **kwargs)
    rec["generations"].append({"completion_ids": answer["completion_ids"],
                               "logprobs": answer["logprobs"], "prompt_ids": answer["prompt_ids"]})
    return answer


trainer.vllm_generation.vllm_client.generate = recorded_generate
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
