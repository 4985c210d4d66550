"""The shape of a separate role's engines: which engine it runs, the devices one engine takes, how many engines
(replicas) it runs, and the env each needs.

Why apart from the command lines (dualrun/methods/commands.py): the plan places the replicas from these facts,
and the plan is pure, below everything that starts a process; both read them here. Pure functions of the config.
"""
from __future__ import annotations

from dualrun.config.model import JobConfig, RoleSpec

# The endpoints TRL's VLLMClient uses (weight transfer, /server_info, prefix-cache reset) live behind dev mode.
ROLLOUT_SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1"}
# Roles whose engines take the trainer's weights (when on vLLM): a restarted replica of one is held out of rotation
# until its first weight update (dualrun/servers/supervision.py).
SYNCED_ROLES = frozenset({"rollout"})


def engine_of(cfg: JobConfig, role: RoleSpec) -> str:
    """`engine:` as set; else vLLM on GPUs and the transformers CPU engine where there are none."""
    if role.engine:
        return role.engine
    return "transformers" if (cfg.use_cpu or role.gpus == 0) else "vllm"


def role_takes_weights(cfg: JobConfig, role: RoleSpec | None) -> bool:
    """Whether the engines of `role` receive the trainer's weights: a rollout on vLLM (dualrun's transformers
    engine has no weight transfer: it serves the model it loaded, as its restart does)."""
    return role is not None and role.name in SYNCED_ROLES and engine_of(cfg, role) == "vllm"


def server_env(cfg: JobConfig, role: RoleSpec) -> dict[str, str]:
    """Env a role's server needs beyond the job's: dev mode for a vLLM rollout server (as `trl vllm-serve` sets)."""
    if role.name == "rollout" and not role.address and engine_of(cfg, role) == "vllm":
        return dict(ROLLOUT_SERVER_ENV)
    return {}


def engine_size(cfg: JobConfig, role: RoleSpec) -> int:
    """Devices (GPUs, or CPU processes where the role has no GPUs) one engine of the role takes: vLLM's
    tensor x data parallel size; dualrun's CPU engine is one process."""
    if engine_of(cfg, role) == "transformers":
        return 1
    return role.tensor_parallel_size * role.data_parallel_size


def replica_count(cfg: JobConfig, role: RoleSpec) -> int:
    """Engines a separate role runs: its GPUs (or CPU processes) over one engine's size. More than one stand
    behind one address, the router's (`dualrun.programs.router`): TRL's trainers take a single server address."""
    return max(1, (role.gpus or role.processes) // engine_size(cfg, role))
