"""Supervised fine-tuning with TRL's `SFTTrainer` on a conversational ({"messages": [...]}) dataset.

    python examples/sft.py --model_name_or_path /tmp/tiny/model --dataset_path /tmp/tiny/data/sft.jsonl \
        --output_dir /tmp/out-sft

Every `SFTConfig` field can be set from the command line (or from a YAML file with `--config`).
"""

from dataclasses import dataclass, field

from datasets import load_dataset
from trl import SFTConfig, SFTTrainer, TrlParser


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(metadata={"help": "Model id or local path."})
    dataset_path: str = field(metadata={"help": "JSON/JSONL file with a `messages` (or `text`) column."})


def no_checkpointing(config: type) -> dict:
    """Activation checkpointing off, by the name this transformers knows (`activation_checkpointing` from 5.2x,
    `gradient_checkpointing` before; an unknown name would come back from the parser as an extra namespace)."""
    return {n: False for n in ("activation_checkpointing", "gradient_checkpointing") if hasattr(config, n)}


def main():
    parser = TrlParser((ScriptArguments, SFTConfig))
    # Small defaults so that a CPU run takes seconds (fp32, no activation checkpointing: TRL defaults to
    # bf16 + checkpointing, which a CPU cannot use). Override any of them on the command line.
    parser.set_defaults(
        **no_checkpointing(SFTConfig),
        output_dir="sft-output", max_steps=8, per_device_train_batch_size=4, learning_rate=1e-3,
        max_length=64, bf16=False, logging_steps=1, save_steps=4, report_to="none",
    )
    script_args, training_args = parser.parse_args_and_config()

    dataset = load_dataset("json", data_files=script_args.dataset_path, split="train")

    trainer = SFTTrainer(model=script_args.model_name_or_path, args=training_args, train_dataset=dataset)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.save_state()


if __name__ == "__main__":
    main()
