"""TRL's SFTTrainer, whose rank 0 SIGKILLs itself inside the save of checkpoint `--kill_step` on the job's first
attempt: after the model, optimizer and its RNG state are written, before `trainer_state.json` (what a rank stopped
mid-save by torchrun or the machine watch would leave). On a restart, rank 0 first writes what the output folder
holds (`--listing`: each entry, and whether it has a trainer_state.json), before the trainer resumes.
`--deepspeed_on_cpu`: leave `use_cpu` unset (DeepSpeed picks its CPU accelerator itself).

    python killed_mid_save.py --model_name_or_path M --dataset_path D --output_dir O --kill_step 4 --listing L.json
"""
import json
import os
import signal
import sys

from datasets import load_dataset
from trl import SFTConfig, SFTTrainer

RESTARTS = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
RANK = int(os.environ.get("RANK", "0"))


def arg(name: str) -> str:
    return sys.argv[sys.argv.index(name) + 1]


class KilledMidSave(SFTTrainer):
    def _save_rng_state(self, output_dir):
        super()._save_rng_state(output_dir)
        if RESTARTS == 0 and RANK == 0 and self.state.global_step == int(arg("--kill_step")):
            os.kill(os.getpid(), signal.SIGKILL)


def main():
    out = arg("--output_dir")
    if RESTARTS and RANK == 0:
        listing = {e: os.path.isfile(os.path.join(out, e, "trainer_state.json")) for e in sorted(os.listdir(out))}
        with open(arg("--listing"), "w") as f:
            json.dump(listing, f)
    args = SFTConfig(output_dir=out, max_steps=6, save_steps=2, per_device_train_batch_size=2, learning_rate=1e-3,
                     max_length=64, bf16=False, use_cpu="--deepspeed_on_cpu" not in sys.argv, logging_steps=1,
                     report_to="none", seed=0,
                     activation_checkpointing=False)
    dataset = load_dataset("json", data_files=arg("--dataset_path"), split="train")
    trainer = KilledMidSave(model=arg("--model_name_or_path"), args=args, train_dataset=dataset)
    trainer.train()


if __name__ == "__main__":
    main()
