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
from functools import partial

from datasets import load_dataset
from transformers import TrainerCallback
from trl import GRPOTrainer

from grpo_probe_common import config, gap, logprobs_of, record_generations, reward, stats, trainer_side, wait_for

model, data, out = sys.argv[1:4]
KILL_AT, STEPS = 2, 5
dataset = load_dataset("json", data_files=data, split="train")
config = config(out, STEPS)
base = f"http://{config.vllm_server_host}:{config.vllm_server_port}"
stats, wait_for = partial(stats, base), partial(wait_for, base)
rec = {"checks": [], "rows": {}}


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
record_generations(trainer, rec)
trainer.train()
rec["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
rec["final_rows"] = stats()["replicas"]
with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(rec, f)
