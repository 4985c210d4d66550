"""An unchanged-style GRPOTrainer built with a GRPOConfig that names no vLLM settings: dualrun fills colocate mode
(`rollout.engine: vllm`, colocated). Records the filled fields and what TRL's colocated vLLM engine generates."""
import json
import os
import sys

from datasets import load_dataset
from trl import GRPOConfig, GRPOTrainer

model, data, out = sys.argv[1:4]
config = GRPOConfig(output_dir=os.path.join(out, "o"), max_steps=1, per_device_train_batch_size=2, num_generations=2,
                    max_completion_length=4, report_to="none", use_cpu=True, bf16=False)
trainer = GRPOTrainer(model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)], args=config,
                      train_dataset=load_dataset("json", data_files=data, split="train"))
from vllm import SamplingParams  # noqa: E402

llm = trainer.vllm_generation.llm
(result,) = llm.generate(["what is 1 plus 2 ?"], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump({"use_vllm": config.use_vllm, "vllm_mode": config.vllm_mode,
               "vllm_tensor_parallel_size": config.vllm_tensor_parallel_size,
               "vllm_enable_sleep_mode": config.vllm_enable_sleep_mode, "engine": type(llm).__name__,
               "tokens": len(result.outputs[0].token_ids)}, f)
