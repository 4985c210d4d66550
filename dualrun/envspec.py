"""Which environment variables a worker gets: one definition for both backends.

torchrun sets the rank variables itself; the Ray backend sets the very same names (`rank_env`), so a
script cannot tell the backends apart except by values the backend defines (LOCAL_RANK is 0 on Ray).
"""
from __future__ import annotations

import fnmatch
import functools
import os
from typing import Mapping

# Exactly the names torch.distributed.run (torch 2.x) gives each worker.
TORCHRUN_NAMES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "OMP_NUM_THREADS",
)

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

_SECRET_PATTERNS = ("*_TOKEN", "*_KEY", "*_SECRET", "*_PASSWORD", "HF_TOKEN", "WANDB_API_KEY", "*TOKEN*", "*SECRET*",
                    "*PASSWORD*", "*API_KEY*")
REDACTED = "***"
# Cloud credentials for checkpoint storage: forwarded, never printed (AWS_ACCESS_KEY_ID has no secret-looking word).
_CREDENTIAL_NAMES = ("AWS_*", "GOOGLE_APPLICATION_CREDENTIALS")


@functools.lru_cache(maxsize=4096)
def is_secret(name: str) -> bool:
    upper = name.upper()
    return any(fnmatch.fnmatchcase(upper, p) for p in _SECRET_PATTERNS + _CREDENTIAL_NAMES)


def redact(env: Mapping[str, str]) -> dict[str, str]:
    """A copy safe to print: secret-looking names keep their key, lose their value."""
    return {k: (REDACTED if is_secret(k) and v else v) for k, v in env.items()}


def allowed(name: str, extra: tuple[str, ...] = ()) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in FORWARD_ALLOWLIST + extra)


def forwarded_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The part of the launching environment that workers inherit (allow-list + DUALRUN_FORWARD_ENV)."""
    environ = os.environ if environ is None else environ
    extra = tuple(p.strip() for p in environ.get("DUALRUN_FORWARD_ENV", "").split(",") if p.strip())
    return {k: v for k, v in environ.items() if allowed(k, extra)}


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
