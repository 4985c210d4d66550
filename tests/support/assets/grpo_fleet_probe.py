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
from functools import partial

from datasets import load_dataset
from transformers import TrainerCallback
from trl import GRPOTrainer

from grpo_probe_common import config, gap, logprobs_of, record_generations, reward, stats, trainer_side, wait_for

model, data, out = sys.argv[1:4]
FIXED = "--fixed" in sys.argv[4:]
GROW_AT, SHRINK_AT, STEPS = 1, 3, 5
dataset = load_dataset("json", data_files=data, split="train")
config = config(out, STEPS)
base = f"http://{config.vllm_server_host}:{config.vllm_server_port}"
stats, wait_for = partial(stats, base), partial(wait_for, base)
rec = {"checks": [], "rows": {}}


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
        if not FIXED and step == GROW_AT + 1:   # its first sync restored it (in rotation once its probes pass: ~2 s)
            rec["rows"]["serving"] = wait_for("replica 1 in rotation", lambda t: 1 in t["in_rotation"], 60)["replicas"]
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
record_generations(trainer, rec)
trainer.train()
rec["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(rec, f)
