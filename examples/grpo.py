"""GRPO with TRL's `GRPOTrainer` and plain Python reward functions (generation with `transformers`, no vLLM).

    python examples/grpo.py --model_name_or_path /tmp/tiny/model --dataset_path /tmp/tiny/data/prompts.jsonl \
        --output_dir /tmp/out-grpo

The dataset has a conversational `prompt` column and an `answer` column, which TRL passes to the reward
functions as a keyword argument. Every `GRPOConfig` field can be set from the command line (`--use_vllm`,
`--num_generations`, ...) or from a YAML file with `--config`.
"""

from dataclasses import dataclass, field

from datasets import load_dataset
from trl import GRPOConfig, GRPOTrainer, TrlParser


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(metadata={"help": "Model id or local path."})
    dataset_path: str = field(metadata={"help": "JSON/JSONL file with `prompt` and `answer` columns."})


def correctness_reward(completions, answer, **kwargs):
    """1.0 when the completion contains the expected answer as a word."""
    return [float(ans in completion[0]["content"].split()) for completion, ans in zip(completions, answer)]


def brevity_reward(completions, **kwargs):
    """Prefer completions of about four words."""
    return [-0.1 * abs(len(completion[0]["content"].split()) - 4) for completion in completions]


def no_checkpointing(config: type) -> dict:
    """Activation checkpointing off, by the name this transformers knows (`activation_checkpointing` from 5.2x,
    `gradient_checkpointing` before; an unknown name would come back from the parser as an extra namespace)."""
    return {n: False for n in ("activation_checkpointing", "gradient_checkpointing") if hasattr(config, n)}


def main():
    parser = TrlParser((ScriptArguments, GRPOConfig))
    # Small defaults so that a CPU run takes seconds (fp32, no activation checkpointing: TRL defaults to
    # bf16 + checkpointing, which a CPU cannot use). Override any of them on the command line.
    parser.set_defaults(
        **no_checkpointing(GRPOConfig),
        output_dir="grpo-output", max_steps=4, per_device_train_batch_size=2, num_generations=2,
        max_completion_length=8, learning_rate=1e-3, bf16=False,
        logging_steps=1, save_steps=2, report_to="none",
    )
    script_args, training_args = parser.parse_args_and_config()

    dataset = load_dataset("json", data_files=script_args.dataset_path, split="train")

    trainer = GRPOTrainer(
        model=script_args.model_name_or_path,
        reward_funcs=[correctness_reward, brevity_reward],
        args=training_args,
        train_dataset=dataset,
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.save_state()


if __name__ == "__main__":
    main()
