"""The command lines of the servers a separate role can run, one per engine.

Why here and not in each plugin: GRPO's rollout and GKD's rollout/teacher start the same engines; the plugins
only choose which one (and check what they need, e.g. a model path).
"""
from __future__ import annotations

import sys

from dualrun.config.model import JobConfig, RoleSpec

HEALTH_PATH = "/health"  # vLLM's OpenAI server (behind `trl vllm-serve` too) and dualrun's CPU engine


def engine_of(cfg: JobConfig, role: RoleSpec) -> str:
    """`engine:` as set; else vLLM on GPUs and the transformers CPU engine where there are none."""
    if role.engine:
        return role.engine
    return "transformers" if (cfg.use_cpu or role.gpus == 0) else "vllm"


def data_parallel(role: RoleSpec) -> int:
    """`data_parallel_size` as set; left at 1, as many replicas as the role's GPUs hold (all GPUs are used)."""
    if role.data_parallel_size == 1 and role.gpus > role.tensor_parallel_size:
        return role.gpus // role.tensor_parallel_size
    return role.data_parallel_size


def trl_vllm_serve(role: RoleSpec, model: str, host: str, port: int) -> list[str]:
    """`trl vllm-serve`: vLLM with the weight-sync endpoints TRL's trainers use for a rollout server."""
    return [sys.executable, "-m", "trl.scripts.vllm_serve", "--model", model, "--host", host, "--port", str(port),
            "--tensor_parallel_size", str(role.tensor_parallel_size),
            "--data_parallel_size", str(data_parallel(role)), *role.server_args]


def vllm_serve(role: RoleSpec, model: str, host: str, port: int) -> list[str]:
    """Plain `vllm serve` (OpenAI API) for a teacher; no logprob cap, so any `top_k` can be asked for."""
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, "--host", host, "--port", str(port),
            "--tensor-parallel-size", str(role.tensor_parallel_size),
            "--data-parallel-size", str(data_parallel(role)), "--max-logprobs", "-1", *role.server_args]


def cpu_engine(role: RoleSpec, model: str, host: str, port: int) -> list[str]:
    """dualrun's transformers engine: the same HTTP subset, for CPUs, tests and laptops."""
    return [sys.executable, "-m", "dualrun.engines.transformers_server", "--model", model, "--host", host,
            "--port", str(port), *role.server_args]


def server_argv(cfg: JobConfig, role: RoleSpec, model: str, host: str, port: int, rollout: bool) -> list[str]:
    if engine_of(cfg, role) == "transformers":
        return cpu_engine(role, model, host, port)
    return trl_vllm_serve(role, model, host, port) if rollout else vllm_serve(role, model, host, port)


def validate_server_role(cfg: JobConfig, role: RoleSpec, serves: str) -> None:
    """Rules every separate role that dualrun starts a server for must meet (a user-run `address:` skips them)."""
    from dualrun.errors import ConfigError

    if role.address:
        return
    key = f"roles.{role.name}"
    if not role.model:
        raise ConfigError(cfg.source, f"{key}.model", f"the model path the {role.name} server serves ({serves})",
                          hint=f"or `{key}.address: host:port` of a server you started yourself")
    engine = engine_of(cfg, role)
    tp, dp = role.tensor_parallel_size, role.data_parallel_size
    if engine == "vllm":
        if role.gpus == 0:
            raise ConfigError(cfg.source, f"{key}.engine", "`transformers` for a role without GPUs (vLLM needs GPUs)",
                              engine)
        if tp * data_parallel(role) != role.gpus:
            raise ConfigError(cfg.source, f"{key}.data_parallel_size",
                              f"tensor_parallel_size x data_parallel_size = {key}.gpus ({role.gpus})",
                              f"{tp} x {dp}")
    elif tp != 1 or dp != 1:
        raise ConfigError(cfg.source, f"{key}.tensor_parallel_size", f"1 with engine `{engine}` (one process)",
                          f"tensor_parallel_size={tp}, data_parallel_size={dp}")
