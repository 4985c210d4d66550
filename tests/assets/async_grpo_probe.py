"""An unchanged-style TRL AsyncGRPOTrainer script (generation overlaps training): it names no vLLM server; dualrun
fills `vllm_server_base_url`. Records the URL it ended with, then trains (on CPU TRL stops at weight-sync init)."""
import json
import os
import sys

from datasets import load_dataset
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

model, data, out = sys.argv[1:4]
config = AsyncGRPOConfig(output_dir=os.path.join(out, "o"), max_steps=1, num_generations=2, max_completion_length=8,
                         report_to="none", use_cpu=True, bf16=False, dtype="float32", logging_steps=1,
                         weight_sync_timeout=60, vllm_server_timeout=60)
with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump({"vllm_server_base_url": config.vllm_server_base_url}, f)


def reward(completions, **kwargs):
    return [float(len(str(c))) for c in completions]


dataset = load_dataset("json", data_files=data, split="train")
trainer = AsyncGRPOTrainer(model=model, reward_funcs=[reward], args=config, train_dataset=dataset)
trainer.train()
