"""Which environment variables a worker gets: one definition for both backends.

torchrun sets the rank variables itself; the Ray backend sets the very same names (`rank_env`), so a
script cannot tell the backends apart except by values the backend defines (LOCAL_RANK is 0 on Ray).
"""
from __future__ import annotations

import fnmatch
import functools
import os
import re
from typing import Mapping

from dualrun.contract import protocol

# Exactly the names torch.distributed.run (torch 2.x) gives each worker.
TORCHRUN_NAMES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "OMP_NUM_THREADS",
)

# Set by dualrun for every process (its rank, rendezvous address, devices, role): a config's `env:` must not
# override them, or ranks would meet on the wrong address or run on the wrong GPUs. OMP_NUM_THREADS stays the user's.
RESERVED_ENV = tuple(n for n in TORCHRUN_NAMES if n != "OMP_NUM_THREADS") + (
    "NODE_RANK", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "TORCHELASTIC_*",
    *protocol.RESERVED)


def reserved(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in RESERVED_ENV)


# Variables of the launching environment that reach workers. Everything else stays on the driver.
# Extend with DUALRUN_FORWARD_ENV="MY_VAR,OTHER_*" or put values under `env:` in the config.
FORWARD_ALLOWLIST = (
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LC_*", "TZ", "TERM", "TMPDIR", "PWD",
    "VIRTUAL_ENV", "CONDA_*", "PYTHONPATH", "PYTHONHASHSEED", "PYTHONUNBUFFERED", "PYTHONWARNINGS",
    "PYTHONDONTWRITEBYTECODE", "LD_LIBRARY_PATH", "LD_PRELOAD", "LIBRARY_PATH",
    "HF_*", "HUGGINGFACE_*", "TRANSFORMERS_*", "TOKENIZERS_*", "DATASETS_*", "TRL_*", "ACCELERATE_*",
    "WANDB_*", "MLFLOW_*", "TENSORBOARD_*", "COMET_*", "NCCL_*", "CUDA_*", "NVIDIA_*", "TORCH_*", "TORCHINDUCTOR_*",
    "TRITON_*", "PYTORCH_*", "OMP_*", "MKL_*", "KMP_*", "OPENBLAS_*", "NVPL_*", "BLIS_*", "GLOO_*", "VLLM_*", "DS_*",
    "DEEPSPEED_*", "XDG_*", "SSL_CERT_*", "REQUESTS_CA_BUNDLE", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY",
    "http_proxy", "https_proxy", "no_proxy", "DUALRUN_*",
    # fabrics (EFA, InfiniBand), AMD devices, checkpoint storage credentials, extension builds
    "FI_*", "UCX_*", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "AWS_*", "GOOGLE_APPLICATION_CREDENTIALS",
    "CC", "CXX", "MAX_JOBS",
)

@functools.lru_cache(maxsize=16)
def _matcher(patterns: tuple[str, ...]) -> tuple[frozenset[str], "re.Pattern[str] | None"]:
    """Exact names in a set, the patterns with wildcards in one compiled expression: matching a name costs one
    set lookup and one match, however many names DUALRUN_FORWARD_ENV lists (10,000 of them stay fast)."""
    exact = frozenset(p for p in patterns if not any(c in p for c in "*?["))
    globs = sorted({p for p in patterns if p not in exact})
    return exact, (re.compile("|".join(fnmatch.translate(p) for p in globs)) if globs else None)


def allowed(name: str, extra: tuple[str, ...] = ()) -> bool:
    exact, globs = _matcher(FORWARD_ALLOWLIST + tuple(extra))
    return name in exact or bool(globs and globs.match(name))


def forward_patterns(value: str) -> tuple[str, ...]:
    """The names and patterns of DUALRUN_FORWARD_ENV (comma-separated)."""
    return tuple(p.strip() for p in value.split(",") if p.strip())


def forwarded_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The part of the launching environment that workers inherit (allow-list + DUALRUN_FORWARD_ENV)."""
    environ = os.environ if environ is None else environ
    exact, globs = _matcher(FORWARD_ALLOWLIST + forward_patterns(environ.get(protocol.FORWARD_ENV, "")))
    return {k: v for k, v in environ.items() if k in exact or (globs is not None and globs.match(k))}


def on_this_node(env: Mapping[str, str]) -> tuple[dict[str, str], str | None]:
    """`env` as a process on this node may take it: the driver's TMPDIR is forwarded only where it exists here
    (another node may have no such directory, and every temp file of the program would fail); else it is dropped,
    so the node's default temp dir is used, and the returned note says so."""
    out = dict(env)
    tmp = out.get("TMPDIR")
    if tmp and not os.path.isdir(tmp):
        del out["TMPDIR"]
        return out, (f"dualrun: TMPDIR={tmp} (the launching machine's) does not exist on this node: not forwarded, "
                     "the node's default temp dir is used")
    return out, None


def rank_env(*, rank: int, world_size: int, local_rank: int, local_world_size: int, node_rank: int,
             num_nodes: int, master_addr: str, master_port: int | str, role_name: str = "default",
             restart_count: int = 0, max_restarts: int = 0, run_id: str = "none", error_file: str = "",
             omp_num_threads: str = "1", agent_store: bool = False) -> dict[str, str]:
    """torchrun's per-worker variables, for backends that start workers themselves."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "GROUP_RANK": str(node_rank),
        "GROUP_WORLD_SIZE": str(num_nodes),
        "ROLE_NAME": role_name,
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": str(master_addr),
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": str(agent_store),
        "TORCHELASTIC_ERROR_FILE": error_file,
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "OMP_NUM_THREADS": omp_num_threads,
    }
