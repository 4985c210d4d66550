"""On-policy distillation with TRL's experimental `GKDTrainer` (Generalized Knowledge Distillation).

    python examples/gkd.py --model_name_or_path /tmp/tiny/model --teacher_model_name_or_path /tmp/tiny/teacher \
        --dataset_path /tmp/tiny/data/gkd.jsonl --output_dir /tmp/out-gkd

The dataset has a conversational `messages` column; the last message is the completion. Every `GKDConfig`
field can be set from the command line (`--lmbda`, `--beta`, `--seq_kd`, ...) or from a YAML file with `--config`.

Note (TRL 1.16): `GKDTrainer.compute_loss` divides the summed per-token divergence by `num_items_in_batch`,
the token count summed over *all* processes, and does not multiply back by the number of processes. With N
processes the logged loss is therefore ~1/N of the single-process value for the same data. This is TRL's
behaviour and is left as is here.
"""

from dataclasses import dataclass, field

from datasets import load_dataset
from transformers import AutoTokenizer
from trl import TrlParser
from trl.experimental.gkd import GKDConfig, GKDTrainer


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(metadata={"help": "Student model id or local path."})
    dataset_path: str = field(metadata={"help": "JSON/JSONL file with a `messages` column."})


def no_checkpointing(config: type) -> dict:
    """Activation checkpointing off, by the name this transformers knows (`activation_checkpointing` from 5.2x,
    `gradient_checkpointing` before; an unknown name would come back from the parser as an extra namespace)."""
    return {n: False for n in ("activation_checkpointing", "gradient_checkpointing") if hasattr(config, n)}


def main():
    parser = TrlParser((ScriptArguments, GKDConfig))
    # Small defaults so that a CPU run takes seconds (fp32, no activation checkpointing: TRL defaults to
    # bf16 + checkpointing, which a CPU cannot use). Override any of them on the command line.
    parser.set_defaults(
        **no_checkpointing(GKDConfig),
        output_dir="gkd-output", max_steps=8, per_device_train_batch_size=2, max_length=64, max_new_tokens=8,
        learning_rate=1e-3, bf16=False, logging_steps=1, save_steps=4,
        report_to="none",
    )
    script_args, training_args = parser.parse_args_and_config()

    tokenizer = AutoTokenizer.from_pretrained(script_args.model_name_or_path)
    dataset = load_dataset("json", data_files=script_args.dataset_path, split="train")

    trainer = GKDTrainer(
        model=script_args.model_name_or_path,
        # `None` distils from a copy of the student, as documented for `teacher_model_name_or_path`.
        teacher_model=training_args.teacher_model_name_or_path or script_args.model_name_or_path,
        args=training_args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.save_state()


if __name__ == "__main__":
    main()
