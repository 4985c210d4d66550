"""The job every launch benchmark runs, and the command line of each launcher that runs it: the unchanged
`examples/sft.py` on the tiny offline model, so the launchers differ in nothing but themselves."""
from __future__ import annotations

import sys
from pathlib import Path

from dualrun.light.ports import free_port

from . import BENCH, REPO

SCRIPT = REPO / "examples" / "sft.py"
CONFIG = REPO / "configs" / "sft_cpu.yaml"

VARIANTS = {  # name -> (label, needs the running cluster)
    "torchrun": ("bare torchrun", False),
    "dualrun-torchrun": ("dualrun --backend torchrun", False),
    "ray-train": ("Ray Train TorchTrainer (running cluster)", True),
    "dualrun-ray": ("dualrun --backend ray (running cluster)", True),
    "dualrun-ray-embedded": ("dualrun --backend ray (embedded, cold)", False),
}
SHORT = {"torchrun": "bare\ntorchrun", "dualrun-torchrun": "dualrun\ntorchrun", "ray-train": "Ray Train\n(running)",
         "dualrun-ray": "dualrun ray\n(running)", "dualrun-ray-embedded": "dualrun ray\n(embedded)"}
BASE = "torchrun"   # the variant every ratio is taken against


def script_args(tiny: Path, out: Path, steps: int) -> list[str]:
    """examples/sft.py's arguments: the tiny model and data, `steps` optimizer steps, no checkpoints."""
    return ["--model_name_or_path", str(tiny / "model"), "--dataset_path", str(tiny / "data" / "sft.jsonl"),
            "--output_dir", str(out), "--max_steps", str(steps), "--save_strategy", "no", "--seed", "1"]


def command(variant: str, args: list[str], nproc: int) -> list[str]:
    """The command line that runs examples/sft.py with `args` on `nproc` processes through `variant`."""
    py = sys.executable
    if variant == "torchrun":
        return [py, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
                "--master-port", str(free_port()), str(SCRIPT), *args]
    if variant == "ray-train":
        return [py, str(BENCH / "benchlib" / "ray_train_driver.py"), "--num-workers", str(nproc), str(SCRIPT), *args]
    backend = "torchrun" if variant == "dualrun-torchrun" else "ray"
    return [py, "-m", "dualrun", "launch", "--backend", backend, "--config_file", str(CONFIG),
            "--num_processes", str(nproc), str(SCRIPT), *args]
