"""Unchanged-style TRL scripts against a rollout server they never name (dualrun fills the address):
1. TRL's AsyncGRPOTrainer (generation overlaps training): records the `vllm_server_base_url` it got, asks the server
   through TRL's async client (health, dtype and world size over the dev-mode endpoints), then builds the trainer
   (on a CPU TRL 1.16 stops there: it reads the CUDA device name for its FLOPs metric).
2. TRL's GRPOTrainer in server mode: records the filled fields, then builds the trainer, which reaches the server
   and, on a CPU, stops at weight-sync initialisation (NCCL needs CUDA): the job ends with that error."""
import json
import os
import sys

from datasets import load_dataset
from trl import GRPOConfig, GRPOTrainer
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from trl.experimental.async_grpo.vllm_client import VLLMClient

model, data, out = sys.argv[1:4]
path = os.path.join(out, f"rank{os.environ['RANK']}.json")
dataset = load_dataset("json", data_files=data, split="train")


def reward(completions, **kwargs):
    return [float(len(str(c))) for c in completions]


common = dict(max_steps=1, num_generations=2, max_completion_length=8, report_to="none", use_cpu=True, bf16=False)
rec = {}
async_config = AsyncGRPOConfig(output_dir=os.path.join(out, "async"), dtype="float32", vllm_server_timeout=60, **common)
rec["async_url"] = async_config.vllm_server_base_url
client = VLLMClient(async_config.vllm_server_base_url, server_timeout=60)
client.wait_for_server_ready()
rec["async_server"] = {"dtype": client.get_dtype(), "world_size": client.get_world_size()}
try:
    AsyncGRPOTrainer(model=model, reward_funcs=[reward], args=async_config, train_dataset=dataset)
    rec["async_error"] = None
except Exception as e:  # noqa: BLE001 - recorded for the test
    rec["async_error"] = f"{type(e).__name__}: {e}"

config = GRPOConfig(output_dir=os.path.join(out, "grpo"), per_device_train_batch_size=2, **common)
rec["grpo"] = {k: getattr(config, k) for k in ("use_vllm", "vllm_mode", "vllm_server_host", "vllm_server_port",
                                               "vllm_group_port")}
with open(path, "w") as f:
    json.dump(rec, f)
GRPOTrainer(model=model, reward_funcs=[reward], args=config, train_dataset=dataset)
