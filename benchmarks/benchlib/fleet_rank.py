"""The trainer fleet_growth.py runs under `dualrun launch`: TRL's unchanged GRPOTrainer against a vLLM rollout fleet,
with a callback and a wrapper that only observe (and stop the run when told).

Why a script of its own: the benchmark needs each weight sync's time and how many engines it reached, and each
step's end, as wall-clock times it can hold against its own (`dualrun scale`'s ask, a kill), from inside the rank.
Appends one JSON line per event to EVENTS (a restarted run appends to the same file):
  {"kind": "start", "t", "resumed": step or null}       the trainer is built (resumed: the checkpoint's step)
  {"kind": "sync", "step", "t0", "t1", "members"}        one `sync_weights` (members: the router's weight-sync
                                                          members as it began: the engines it reaches)
  {"kind": "step", "step", "t"}                          a step ended (its checkpoint follows: save_steps 1)
The run ends when OUT/stop exists (at the next step's end). `--resume`: from the newest checkpoint in OUT/grpo.

    fleet_rank.py MODEL PROMPTS.jsonl OUT EVENTS [--resume]
"""
import json
import os
import sys
import time

import requests
from datasets import load_dataset
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint
from trl import GRPOConfig, GRPOTrainer

model, data, out, EVENTS = sys.argv[1:5]
RESUME = "--resume" in sys.argv[5:]
config = GRPOConfig(output_dir=os.path.join(out, "grpo"), per_device_train_batch_size=4, max_steps=10_000,
                    learning_rate=0.05, logging_steps=1, seed=0, generation_kwargs={"seed": 7}, num_generations=2,
                    max_completion_length=8, report_to="none", use_cpu=True, bf16=False, save_strategy="steps",
                    save_steps=1, save_total_limit=2)
base = f"http://{config.vllm_server_host}:{config.vllm_server_port}"


def event(**rec) -> None:
    with open(EVENTS, "a") as f:
        f.write(json.dumps(rec) + "\n")


def members() -> int:
    table = requests.get(f"{base}/router/stats", timeout=30).json()
    return sum(bool(r.get("member")) for r in table["replicas"])


def reward(completions, **kwargs):
    return [float(sum(map(ord, str(c))) % 7) for c in completions]


class Observe(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        event(kind="step", step=state.global_step, t=time.time())
        if os.path.exists(os.path.join(out, "stop")):
            control.should_training_stop = True


dataset = load_dataset("json", data_files=data, split="train")
trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=config, train_dataset=dataset, callbacks=[Observe()])
sync = trainer.vllm_generation.sync_weights


def timed_sync():
    reach = members()   # a replica joins the router's members when it is started; this sync re-forms the group
    t0 = time.time()    # with it (dualrun/weightsync/trainer/regroup.py) and reaches it
    sync()
    t1 = time.time()
    event(kind="sync", step=trainer.state.global_step, t0=t0, t1=t1, members=reach)


trainer.vllm_generation.sync_weights = timed_sync
last = get_last_checkpoint(config.output_dir) if RESUME and os.path.isdir(config.output_dir) else None
event(kind="start", t=time.time(), resumed=int(last.rsplit("-", 1)[1]) if last else None)
trainer.train(resume_from_checkpoint=last)
