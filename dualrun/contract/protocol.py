"""The driver-worker protocol: every environment variable dualrun passes between the driver and its workers.

Why one module: each name is written in one module and read in others, so it is defined once: renaming or adding
one is one edit, and a writer and its readers cannot drift apart. The driver writes them, the workers (torchrun
ranks, Ray actors, role programs, plugins) read them; both import the names from here.

Standard library only: Ray worker processes import it before (and without) torch.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

# -- set by the driver for every worker ---------------------------------------------------------------------
BACKEND = "DUALRUN_BACKEND"         # 'torchrun' | 'ray'
METHOD = "DUALRUN_METHOD"           # the method plugin the workers activate
RUN_ID = "DUALRUN_RUN_ID"           # one id per launch (filled in by the launcher)
JOB_TOKEN = "DUALRUN_JOB_TOKEN"     # the job's secret (contract/job_token.py): one per launch, or the launching env's
SETTINGS = "DUALRUN_SETTINGS"       # JSON of `Settings`
ROLE = "DUALRUN_ROLE"               # the plan's unit ('train', 'teacher+rollout'), or a role group's name
ROLES = "DUALRUN_ROLES"             # comma-separated roles of the unit
JOB_RESTARTS = "DUALRUN_JOB_RESTARTS"  # restarts of the whole job by dualrun (a server died), torchrun only
LOG_DIR = "DUALRUN_LOG_DIR"         # torchrun: each rank also appends its output to LOG_DIR/<ROLE>_<RANK>.log (on Ray
                                    # the rank's actor writes that file)
ADDRESS_PATTERN = "DUALRUN_*_ADDRESS"  # a separate role's `host:port` (see `address_env`)
API_KEY_PATTERN = "DUALRUN_*_API_KEY"  # a separate role's `--api-key`, for the trainers' requests (see `api_key_env`)

# -- role programs (dualrun.role_programs) -------------------------------------------------------------------
ROLES_SPEC = "DUALRUN_ROLES_SPEC"   # JSON of RolesSpec, set by `dualrun launch` for a role program
ROLES_MODE = "DUALRUN_ROLES_MODE"   # 'ray' (this process is the driver of a Ray job) | 'local'
GROUP_RANK = "DUALRUN_GROUP_RANK"   # a role group worker's rank in its group
GROUP_SIZE = "DUALRUN_GROUP_SIZE"   # the number of workers of the group

# Several vLLM CPU engines on one machine (dualrun/plan/processes.py): 'j/k' = this engine is the j-th of k there, and binds its
# OpenMP threads to the j-th k-th of the machine's allowed cores where it starts (dualrun/servers/cpu_share.py).
CPU_SHARE = "DUALRUN_CPU_SHARE"
# Every vLLM CPU engine (dualrun/plan/processes.py): '1' = vLLM's shared-memory queue readers wait for the writer's
# signal instead of spinning a second after each message (dualrun/servers/quiet_readers.py, a vLLM plugin).
QUIET_READERS = "DUALRUN_VLLM_QUIET_READERS"

# -- trainer wiring ------------------------------------------------------------------------------------------
# A free port on trainer rank 0's node for TRL's weight-sync rendezvous (the trainer is its master): TRL's default
# 51216 makes two jobs with rollout servers on one node collide.
VLLM_GROUP_PORT = "DUALRUN_VLLM_GROUP_PORT"
# Seconds the weight-sync group may take to form, on both ends (the trainer's rank 0 and each vLLM worker's
# extension): the `weight_sync_timeout_s` key, in the env of the trainers and the rollout servers.
WEIGHT_SYNC_TIMEOUT_S = "DUALRUN_WEIGHT_SYNC_TIMEOUT_S"
# Servers started beside the trainers: JSON {"servers": {"host:port": role}, "wait_s": seconds}; a rank's first
# connection to one waits while it refuses (dualrun/rank/server_wait.py). Set only while the servers start.
SERVERS_STARTING = "DUALRUN_SERVERS_STARTING"
# Multi-node torchrun: the servers' addresses travel through torchrun's store (dualrun/rank/store_wiring.py).
WIRING_FETCH = "DUALRUN_WIRING_FETCH"       # 'host:port' of the store to read the wiring from (machine 0's launcher
                                            # puts it there: main_process_ip:main_process_port, whatever rdzv_backend)

# The rollout router's weight-transfer membership (`GET` it: `{"membership": int, "members": [int]}`): the number grows
# when a replica leaves the weight-sync group (dead, being restarted) or joins it (its replacement); the trainer's side
# compares it before each sync and re-forms its group when it changed (dualrun/weightsync/trainer/vllm_client.py serves it by
# dualrun/programs/router.py). A single engine answers 404: no membership to follow.
ROUTER_MEMBERSHIP_PATH = "/router/membership"
# The trainer's global step (`trainer.state.global_step`) when it sent a request to the job's servers, added by the
# ranks' hook (dualrun/rank/server_auth.py) once a trainer trains: a router reads it to tell from which step a joining
# replica serves (its first weight update's, or its first answered request's; dualrun/programs/rotation.py).
STEP_HEADER = "X-Dualrun-Step"

# -- set by the user (read by workers or the driver) ---------------------------------------------------------
PROGRESS = "DUALRUN_PROGRESS"              # rank0 (default) | all | none
EXIT_TIMEOUT_S = "DUALRUN_EXIT_TIMEOUT_S"  # the exit watchdog's limit (default 60 s)
CACHE = "DUALRUN_CACHE"                    # '0': no on-disk cache of accelerate's env
JOBS_DIR = "DUALRUN_JOBS_DIR"              # where `dualrun scale` finds the running jobs (launchers/job_registry.py)
DEBUG = "DUALRUN_DEBUG"                    # '1': print the traceback of an unexpected error
FORWARD_ENV = "DUALRUN_FORWARD_ENV"        # more launching-env names (patterns) to forward to the workers

# The entry-point group third-party method plugins register under (read by the driver and by every worker).
PLUGIN_ENTRY_POINTS = "dualrun.plugins"
BACKEND_ENTRY_POINTS = "dualrun.backends"   # a backend of another distribution (config/backends.py)

# Names the driver sets for every process: a config's `env:` must not override them.
RESERVED = (BACKEND, METHOD, ROLE, ROLES, RUN_ID, JOB_TOKEN, SETTINGS, ROLES_MODE, ROLES_SPEC, ADDRESS_PATTERN,
            API_KEY_PATTERN, LOG_DIR, QUIET_READERS, SERVERS_STARTING)


def address_env(role: str) -> str:
    """The variable holding a separate role's `host:port` for the trainer ranks ('rollout' -> DUALRUN_ROLLOUT_ADDRESS)."""
    return f"DUALRUN_{role.upper()}_ADDRESS"


def address_role(name: str) -> str | None:
    """The role whose `host:port` the variable `name` holds (DUALRUN_ROLLOUT_ADDRESS -> 'rollout'), else None."""
    prefix, _, suffix = ADDRESS_PATTERN.partition("*")
    if name.startswith(prefix) and name.endswith(suffix) and len(name) > len(prefix) + len(suffix):
        return name[len(prefix):-len(suffix)].lower()
    return None


def api_key_env(role: str) -> str:
    """The variable holding a separate role's `--api-key` (from its server_args) for the trainer ranks' requests."""
    return f"DUALRUN_{role.upper()}_API_KEY"


ROLLOUT_ADDRESS = address_env("rollout")
TEACHER_ADDRESS = address_env("teacher")


def group_port_env(weight_sync: bool, port: int | None) -> dict[str, str]:
    """The trainers' weight-sync port, for jobs whose trainers push their weights to a separate role's engines
    (`Plan.weight_sync`; picked where rank 0 runs: the torchrun driver's machine, or rank 0's Ray actor, alongside
    MASTER_PORT)."""
    return {VLLM_GROUP_PORT: str(port)} if port and weight_sync else {}


@dataclass(frozen=True)
class RoleSettings:
    """What a worker needs to know about one role of the job."""

    gpus: int = 0
    processes: int = 1
    engine: str | None = None
    tensor_parallel_size: int | None = None
    data_parallel_size: int | None = None
    model: str | None = None
    top_k: int | None = None
    separate: bool = False


@dataclass(frozen=True)
class Settings:
    """The job settings the workers read (DUALRUN_SETTINGS): written by the plan, read by plugins and hooks."""

    offload_model: bool = False
    offload_optimizer: bool = False
    max_failures: int = 0
    collective_timeout_s: float | None = None
    roles: Mapping[str, RoleSettings] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"offload_model": self.offload_model, "offload_optimizer": self.offload_optimizer,
                "max_failures": self.max_failures, "collective_timeout_s": self.collective_timeout_s,
                "roles": {name: asdict(role) for name, role in self.roles.items()}}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def to_env(self) -> dict[str, str]:
        return {SETTINGS: self.to_json()}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "Settings":
        """Missing keys take their defaults; unknown ones are ignored (a partial JSON is fine)."""
        known = {f for f in RoleSettings.__dataclass_fields__}
        roles = {name: RoleSettings(**{k: v for k, v in (role or {}).items() if k in known})
                 for name, role in (raw.get("roles") or {}).items()}
        top = {k: raw[k] for k in ("offload_model", "offload_optimizer", "max_failures", "collective_timeout_s")
               if k in raw}
        return cls(**top, roles=roles)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        environ = os.environ if environ is None else environ
        raw = environ.get(SETTINGS)
        return cls.from_dict(json.loads(raw)) if raw else cls()


# -- what the Ray actors answer the driver (picklable; the actor modules import only the standard library) ----
@dataclass(frozen=True)
class ActorPlace:
    """Where an actor landed (a rank, a server or a role worker): its node, the GPUs Ray gave it, its pid, and
    the free ports it picked on its node when asked (a rank 0: MASTER_PORT and the weight-sync port; a server:
    its own port)."""

    ip: str
    node_id: str
    gpus: tuple[str, ...]
    pid: int
    port: int | None = None
    group_port: int | None = None
    tmp: str | None = None                      # a rank's temp dir on its node
    visible_devices: str | None = None          # CUDA_VISIBLE_DEVICES as the actor sees it
    interface: str | None = None                # its node's interface holding `ip` (gloo's, on several nodes)
    taken: str | None = None                    # rank 0: why its `port` (main_process_port) cannot be listened on

    @property
    def address(self) -> str:
        return f"{self.ip}:{self.port}"


@dataclass(frozen=True)
class RankExit:
    """A rank's program ended: its exit code, when (for attributing the first failure), its error, and (Python
    API) its pickled return value."""

    exit_code: int
    end: float
    error: str | None = None
    value: bytes | None = None


@dataclass(frozen=True)
class ServerStart:
    """A server actor's start: healthy at `address`, or the error (never an exception: it must cross Ray intact);
    `port_in_use` when the port it picked was taken meanwhile (the driver retries on a fresh one)."""

    ok: bool
    address: str | None = None
    pid: int | None = None
    error: str | None = None
    port_in_use: bool = False


@dataclass(frozen=True)
class WorkerStats:
    """A role worker's counters: calls served, bytes received through the object store (when tracked)."""

    calls: int
    bytes_in: int | None = None
