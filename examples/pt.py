"""Causal-LM pre-training with the plain `transformers.Trainer`.

    python examples/pt.py --model_name_or_path /tmp/tiny/model --dataset_path /tmp/tiny/data/pt.jsonl \
        --output_dir /tmp/out-pt

Every `TrainingArguments` field can be set from the command line (`--learning_rate 1e-3`, `--max_steps 20`, ...).
"""

from dataclasses import dataclass, field

from datasets import load_dataset
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
)


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(metadata={"help": "Model id or local path."})
    dataset_path: str = field(metadata={"help": "JSON/JSONL file with a `text` column."})
    max_length: int = field(default=64, metadata={"help": "Truncate samples to this many tokens."})


def main():
    parser = HfArgumentParser((ScriptArguments, TrainingArguments))
    # Small defaults so that a CPU run takes seconds; override any of them on the command line.
    parser.set_defaults(
        output_dir="pt-output", max_steps=8, per_device_train_batch_size=4, learning_rate=1e-3,
        logging_steps=1, save_steps=4, report_to="none",
    )
    script_args, training_args = parser.parse_args_into_dataclasses()

    tokenizer = AutoTokenizer.from_pretrained(script_args.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(script_args.model_name_or_path)

    dataset = load_dataset("json", data_files=script_args.dataset_path, split="train")

    def tokenize(batch):
        texts = [text + tokenizer.eos_token for text in batch["text"]]
        return tokenizer(texts, truncation=True, max_length=script_args.max_length)

    with training_args.main_process_first(desc="tokenizing the dataset"):
        dataset = dataset.map(tokenize, batched=True, remove_columns=dataset.column_names)

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=dataset,
        processing_class=tokenizer,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.save_state()


if __name__ == "__main__":
    main()
