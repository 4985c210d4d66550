"""A small unchanged-style GKD script (TRL's GKDTrainer, teacher given by path) that also records what it saw."""
import argparse
import json
import os

from datasets import load_dataset
from transformers import AutoTokenizer
from trl.experimental.gkd import GKDConfig, GKDTrainer

p = argparse.ArgumentParser()
p.add_argument("--model_name_or_path", required=True)
p.add_argument("--teacher_model_name_or_path", required=True)
p.add_argument("--data", required=True)
p.add_argument("--output_dir", required=True)
p.add_argument("--max_steps", type=int, default=2)
p.add_argument("--crash_at_step", type=int, default=-1)
p.add_argument("--hold_file", default="")
p.add_argument("--hold_at_step", type=int, default=1)
p.add_argument("--hold_steps", default="", help="S,T,...: after each, every rank waits while HOLD_FILE.S exists")
a = p.parse_args()

config = GKDConfig(output_dir=a.output_dir, max_steps=a.max_steps, per_device_train_batch_size=2, lmbda=0.5,
                   beta=0.5, max_new_tokens=4, max_length=64, use_cpu=True, report_to="none", logging_steps=1,
                   save_strategy="no", seed=0, learning_rate=1e-3, teacher_model_name_or_path=a.teacher_model_name_or_path)
tok = AutoTokenizer.from_pretrained(a.model_name_or_path)
data = load_dataset("json", data_files=a.data, split="train")
trainer = GKDTrainer(model=a.model_name_or_path, teacher_model=config.teacher_model_name_or_path, args=config,
                     train_dataset=data, processing_class=tok)
if a.crash_at_step >= 0:
    from transformers import TrainerCallback

    class Crash(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step >= a.crash_at_step and os.environ.get("RANK") == "1":
                raise RuntimeError("trainer rank 1 crashed on purpose")

    trainer.add_callback(Crash())
if a.hold_file:   # the test's gate: after step `hold_at_step` every rank waits while the file exists
    import time

    from transformers import TrainerCallback

    gates = {int(s): f"{a.hold_file}.{s}" for s in a.hold_steps.split(",") if s} or {a.hold_at_step: a.hold_file}

    class Hold(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            gate = gates.get(state.global_step)
            if gate is not None:
                open(f"{gate}.held{os.environ.get('RANK', '0')}", "w").close()
                while os.path.exists(gate):
                    time.sleep(0.1)

    trainer.add_callback(Hold())
trainer.train()
losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
rank = os.environ.get("RANK", "0")
with open(os.path.join(a.output_dir, f"rank{rank}.json"), "w") as f:
    json.dump({"teacher": type(trainer.teacher_model).__name__, "losses": losses,
               "teacher_address": os.environ.get("DUALRUN_TEACHER_ADDRESS"),
               "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}, f)
