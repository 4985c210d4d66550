"""The dualrun keys of a config file: one table drives validation and the generated reference."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dualrun.config.backends import BUILT_IN
from dualrun.config.engine_kinds import names as engine_names
from dualrun.contract import protocol


@dataclass(frozen=True)
class Key:
    """One config key: its type, default and meaning (rendered into docs/config-reference.md)."""

    name: str
    type: str  # bool | int | float | str | dict | list | role-map | groups | str-or-null
    default: Any
    doc: str
    backends: str = "both"
    choices: tuple = ()
    minimum: float | None = None
    maximum: float | None = None


# Bounds: what a cluster can hold and what a config file may be. Validation reads them from here; the reference
# lists them. A count past these is a typo or an attack, never a job.
MAX_CONFIG_BYTES = 256 * 1024
MAX_YAML_DEPTH = 50
MAX_YAML_NODES = 100_000
MAX_PROCESSES = 65_536        # processes of one role (and so the world size of a job)
MAX_MACHINES = 16_384
MAX_DEVICE_ID = 1_023         # a device id on one node
MAX_PER_MACHINE = MAX_DEVICE_ID + 1   # torchrun processes on one machine
MAX_SECONDS = 7 * 24 * 3600.0
MAX_RESTARTS = 1_000
MAX_CPUS = 4_096.0            # CPUs of one process
MAX_TOP_K = 1_000_000         # a vocabulary's size
MAX_ENV_ENTRY_BYTES = 128 * 1024   # one NAME=value for execve (the kernel's MAX_ARG_STRLEN)
MIN_INTERVAL_S = 0.01         # torchrun's monitor interval: 0 would spin a core
MIN_TIMEOUT_S = 1.0           # every timeout: a shorter one ends what it guards before it can happen (0: at once)
MIN_JOB_TOKEN_CHARS = 16      # a job secret one can guess is none (dualrun's own are 43 characters)
LIMITS: tuple[tuple[str, Any, str], ...] = (
    ("config file", f"{MAX_CONFIG_BYTES // 1024} KiB", "a regular file (not a FIFO or device), UTF-8 YAML"),
    ("YAML nesting", MAX_YAML_DEPTH, "levels, aliases expanded"),
    ("YAML values", MAX_YAML_NODES, "scalars, lists and mappings, aliases expanded"),
    ("processes of a role / num_processes", MAX_PROCESSES, "the world size of one job"),
    ("num_machines", MAX_MACHINES, "nodes of one job"),
    ("processes per machine (torchrun)", MAX_PER_MACHINE, "num_processes / num_machines, plus machine 0's "
     "servers; `torchrun.gpus_per_machine` must hold each machine's trainers"),
    ("server processes of a separate CPU role", MAX_PER_MACHINE, "one engine each"),
    ("device ids", f"0-{MAX_DEVICE_ID}", "`gpu_ids`, `device_groups` ranks (ranges are bounded before expanding)"),
    ("ports", "1-65535", "`main_process_port`, `address` ports; unset for a free one"),
    ("timeouts and intervals", f"{MAX_SECONDS:g} s", f"finite numbers (no .nan, no .inf); every timeout at least "
     f"{MIN_TIMEOUT_S:g} s"),
    ("an environment variable", f"{MAX_ENV_ENTRY_BYTES // 1024} KiB", "`NAME=value` of `env:`, `roles.*.env`, "
     "`ray.runtime_env.env_vars` (the kernel's limit); names without `=` or NUL, values without NUL"),
    ("paths", "checked here", "`log_dir`: a directory (or none yet) outside /proc and /sys, not below a file, on "
     "a writable file system where dualrun may write; a server `model` written as a local path (`/`, `./`, `../`, `~`): an existing directory, never a URL; "
     "`ray.runtime_env.working_dir`: an existing directory or a URI"),
    ("`server_args` items", "one word each", "non-empty strings without NUL; a flag with its value in one item "
     "(`\"--dtype float32\"`) refused (a value may hold spaces: `'{\"a\": 1}'`); dualrun's own flags refused in "
     "any spelling, abbreviation or packing (`--po 9000`, `-tp2`)"),
)

# The variables a user sets for dualrun itself (names in dualrun/contract/protocol.py, plus Ray's RAY_ADDRESS): checked like
# config keys before anything starts (dualrun/config/environment.py), listed in the reference.
ENV_VARS: tuple[tuple[str, str, str], ...] = (
    (protocol.PROGRESS, "rank0, all or none", "whose progress bars the console shows (Ray backend); default rank0"),
    (protocol.EXIT_TIMEOUT_S, f"a number of seconds in [{MIN_TIMEOUT_S:g}, {MAX_SECONDS:g}]",
     "how long a finished rank may take to exit before its stacks are printed; default 60"),
    (protocol.FORWARD_ENV, "comma-separated variable names or patterns (`MY_VAR,MY_PREFIX_*`)",
     "more launching-environment variables for the workers; not `*` alone, no `NAME=value`"),
    (protocol.CACHE, "0 or 1", "0: no on-disk cache of accelerate's environment"),
    (protocol.DEBUG, "0 or 1", "1: print the traceback of an unexpected error"),
    (protocol.JOBS_DIR, "a directory (made when missing, mode 0700)", "where a launch registers itself for "
     "`dualrun scale` and where `dualrun scale` looks; default `$XDG_RUNTIME_DIR/dualrun/jobs`, else "
     "`~/.cache/dualrun/jobs`; refused when it is not this user's alone"),
    (protocol.JOB_TOKEN, f"at least {MIN_JOB_TOKEN_CHARS} printable ASCII characters, no spaces (empty: unset)",
     "the job's secret instead of a fresh one per launch; never printed. torchrun on several machines: unset, "
     "machine 0 makes one and hands it to the others through its store at `main_process_ip:main_process_port` "
     "(whoever reaches that store can read it, as with torchrun's store itself); set, the same value on every "
     "machine, never put in the store"),
    ("RAY_ADDRESS", "HOST:PORT, ray://HOST:PORT, auto or local",
     "the Ray cluster to join (`--backend ray`); the GCS address, not the dashboard's http:// URL"),
)
# Variables accelerate's env preparation reads with int() or as a truth value (`accelerate launch` would fail on a
# bad one, and so did dualrun, blaming the config file): checked with the others, the variable named.
ACCELERATE_ENV_INTS = ("OMP_NUM_THREADS", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE")
ACCELERATE_ENV_FLAGS = ("USE_TORCH_XLA",)
TRUTH_VALUES = ("1", "0", "true", "false", "yes", "no", "y", "n", "t", "f", "on", "off")   # accelerate's str_to_bool
ENV_VARS += tuple((name, "an integer", "read by accelerate's launch preparation (as `accelerate launch` reads it)")
                  for name in ACCELERATE_ENV_INTS)
ENV_VARS += tuple((name, "a truth value (1/0, true/false, yes/no, on/off)", "read by accelerate when it is imported")
                  for name in ACCELERATE_ENV_FLAGS)


TOP_KEYS: tuple[Key, ...] = (
    Key("backend", "str", "torchrun", "Where workers run; `--backend` overrides. Any installed backend: the "
        f"built-in {', '.join(f'`{n}`' for n, _ in BUILT_IN)}, or one another package registers under the "
        "entry-point group `dualrun.backends` (docs/plugins.md); another name is refused naming those installed."),
    Key("use_ray", "bool", False, "ms-swift's spelling: `use_ray: true` means `backend: ray` (when `backend` is "
        "not set)."),
    Key("method", "str", "sft", "Method plugin: which roles exist and how the trainer is wired "
        "(built in: sft, pt, grpo, gkd, sampling; more via the `dualrun.plugins` entry point)."),
    Key("roles", "role-map", None, "Per-role resources, `{name: {gpus: N, ...}}`. Default: "
        "`{train: {gpus: num_processes}}`."),
    Key("colocate_groups", "groups", [], "Lists of roles that share the same GPUs (equal `gpus` required); "
        "a role not in a group with `train` runs separately on its own GPUs."),
    Key("offload_model", "bool", False, "Colocate: put the rollout engine to sleep between phases "
        "(TRL `vllm_enable_sleep_mode`; TRL 1.16 always sleeps at level 2, discarding weights). Only with a vLLM "
        "rollout colocated with the trainers (`engine: vllm`, method grpo); refused elsewhere."),
    Key("offload_optimizer", "bool", False, "Offload optimizer state to CPU: sets the accelerate DeepSpeed config's "
        "`offload_optimizer_device: cpu` where it is unset or `none` (TRL's zero*.yaml; `nvme` is kept). Needs "
        "`distributed_type: DEEPSPEED` with ZeRO stage 1-3 (stage 0 offloads nothing); refused otherwise."),
    Key("max_failures", "int", 0, "Restarts of the whole job after a worker or node failure; the trainer "
        "resumes from the newest checkpoint in its output_dir.", minimum=0, maximum=MAX_RESTARTS),
    Key("collective_timeout_s", "float", None, "Seconds a collective (all-reduce, barrier, ...) may wait for the "
        "other ranks before failing: TrainingArguments' `ddp_timeout` where left at its default, and "
        "`torch.distributed.init_process_group`'s `timeout` where the script passes none. Unset: the "
        "libraries' own defaults (HF: 1800 s).", minimum=MIN_TIMEOUT_S, maximum=MAX_SECONDS),
    Key("weight_sync_timeout_s", "float", 120.0, "Seconds the trainer's weight-sync group with the vLLM rollout "
        "engines dualrun starts may take to form (trainer rank 0 and every replica's workers meeting at rank 0's "
        "address and `vllm_group_port`), on both ends: past it the job ends with one line naming trainer rank 0's "
        "address and port and the replica. Each transfer once formed keeps its own 600 s bound.",
        minimum=MIN_TIMEOUT_S, maximum=MAX_SECONDS),
    Key("env", "dict", {}, "Extra environment variables for every worker (values are turned into strings)."),
    Key("log_dir", "str-or-null", None, "Also write each rank's output to `LOG_DIR/<role>_<rank>.log` (appended), "
        "and each separate role's server's to `LOG_DIR/<role>-server-<i>.log` (a router's: `<role>-router.log`; "
        "without log_dir, servers log to a temp dir). Under torchrun, torchrun's own per-rank files "
        "(`LOG_DIR/<run id>/attempt_<n>/<local rank>/`) too, unless `torchrun.log_dir` puts them elsewhere."),
    Key("ray", "dict", {}, "Ray backend settings (see `ray.*`).", backends="ray"),
    Key("torchrun", "dict", {}, "torchrun backend settings (see `torchrun.*`).", backends="torchrun"),
)

RAY_KEYS: tuple[Key, ...] = (
    Key("address", "str-or-null", None, "`auto` joins the running cluster (or RAY_ADDRESS); `local` always "
        "starts an embedded one; unset: join a running cluster if there is one, else start an embedded one.",
        backends="ray"),
    Key("placement_strategy", "str", "PACK", "First strategy tried for each role's placement group; "
        "PACK falls back to SPREAD.", backends="ray", choices=("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")),
    Key("placement_timeout_s", "float", 120.0, "Seconds to wait for a placement group before failing with "
        "what was asked and what the cluster has.", backends="ray", minimum=MIN_TIMEOUT_S, maximum=MAX_SECONDS),
    Key("num_cpus_per_worker", "float", 1.0, "CPUs reserved for each worker actor.", backends="ray", minimum=0,
        maximum=MAX_CPUS),
    Key("include_dashboard", "bool", False, "Start the dashboard of an embedded cluster.", backends="ray"),
    Key("runtime_env", "dict", {}, "Ray runtime_env for the worker actors (e.g. `working_dir`, `pip`).",
        backends="ray"),
)

TORCHRUN_KEYS: tuple[Key, ...] = (
    Key("rdzv_backend", "str", "static", "torchrun rendezvous backend; unset: accelerate's top-level "
        "`rdzv_backend` where the file has one (both set: they must agree).", backends="torchrun",
        choices=("static", "c10d")),
    Key("monitor_interval", "float", 0.1, "Seconds between torchrun's checks of its workers.",
        backends="torchrun", minimum=MIN_INTERVAL_S, maximum=MAX_SECONDS),
    Key("log_dir", "str-or-null", None, "torchrun's own `--log-dir` (per-rank stdout/stderr files).",
        backends="torchrun"),
    Key("gpus_per_machine", "int", None, "GPUs of each machine (all alike; on CPU: process slots). Separate "
        "roles' engine replicas then take the GPUs the trainers leave, machine 0's first, then machine 1's, ... "
        "(each replica on one machine). Unset: the launching shell's CUDA_VISIBLE_DEVICES count when set, else "
        "machine 0 holds every server (a role with `machines`: its first machine).", backends="torchrun", minimum=1,
        maximum=MAX_PER_MACHINE),
    Key("machine_timeout_s", "float", 60.0, "Several machines: seconds a machine may go without a sign of life "
        "(each launcher writes one a second to machine 0's store) before the job ends on every machine that is "
        "left, naming it (lost, or its link cut), instead of its ranks waiting out the collective timeout.",
        backends="torchrun", minimum=MIN_TIMEOUT_S, maximum=MAX_SECONDS),
    Key("rendezvous_timeout_s", "int", 600, "Several machines: whole seconds each machine waits for the others to "
        "join the job (torchrun's static rendezvous `--rdzv-conf timeout`, `join_timeout` with `rdzv_backend: "
        "c10d`) before it ends, naming the machines that did not come (machine 0) or machine 0 (the others).",
        backends="torchrun", minimum=MIN_TIMEOUT_S, maximum=MAX_SECONDS),
)

ROLE_KEYS: tuple[Key, ...] = (
    Key("gpus", "int", None, "GPUs (processes, one each) of the role; on CPU the number of processes. A separate "
        "role runs `gpus / tensor_parallel_size` engine replicas behind one address (a router).", minimum=0,
        maximum=MAX_PROCESSES),
    Key("processes", "int", None, "Processes of the role when it differs from `gpus` (CPU-only roles).", minimum=1,
        maximum=MAX_PROCESSES),
    Key("gpu_ids", "str-or-null", None, "Fixed device ids on the node (torchrun), e.g. `0,1` or `[0, 1]`, one per "
        "GPU of the role. Refused on Ray (Ray gives each rank and server its GPUs) and on a CPU config.",
        backends="torchrun"),
    Key("engine", "str", None, "Inference engine of a separate role's server, of a colocated rollout (grpo: `vllm` "
        "is TRL's colocate mode) or of a role program's group; refused where nothing reads it (the trainer role, "
        "beside `address`; a colocated teacher keeps its separate server's, unread).",
        choices=engine_names()),
    Key("tensor_parallel_size", "int", 1, "GPUs of one engine of the role; must divide `gpus` (each further multiple is "
        "another replica behind the role's router; the CPU engine is always 1). A separate role's server, or a "
        "colocated vLLM rollout; refused on the trainer role.",
        minimum=1, maximum=MAX_PROCESSES),
    Key("data_parallel_size", "int", 1, "Data-parallel size of the role's engine (a separate role's server only).",
        minimum=1, maximum=MAX_PROCESSES),
    Key("model", "str-or-null", None, "Model path or name the role serves: a separate role's server, a role "
        "program's group, gkd's teacher (colocated: GKDConfig's teacher; beside `address`: its vocabulary size). "
        "Refused where nothing reads it: the trainer role (the script loads the trained model), beside `address` "
        "elsewhere. A role colocated with the trainers keeps it unread (it generates with the trainers' model), so "
        "that `colocate_groups` alone switches a file between the two layouts."),
    Key("top_k", "int", None, "gkd's teacher only (refused on every other role): top-k log-probabilities distilled "
        "per token (unset or 0: full vocabulary, colocated teacher only; a separate teacher needs >= 1).", minimum=0,
        maximum=MAX_TOP_K),
    Key("address", "str-or-null", None, "`host:port` of a server the user started; dualrun starts none (so "
        "`gpus`, `processes`, `gpu_ids`, `engine`, the parallel sizes, `server_args`, `health_timeout_s`, "
        "`request_timeout_s`, `env` and "
        "`colocate_groups` are refused beside it)."),
    Key("health_timeout_s", "float", 600.0, "Seconds a server dualrun starts may take to answer its health check; "
        "the trainers, started beside it, wait for it where they first use it, and past this the job ends naming it.",
        minimum=MIN_TIMEOUT_S, maximum=MAX_SECONDS),
    Key("request_timeout_s", "float", 1800.0, "Seconds a server dualrun starts for the role may go unanswered "
        "before it is taken for hung. Behind a router (a role with several engine replicas): one generation or "
        "scoring request to a replica, after which the router takes it out of rotation until the launcher restores "
        "or replaces it, the request retried on another replica (none left: the request fails, naming each). Long "
        "by default: one request may carry a whole step's generations (TRL's server-mode client sends them in one "
        "call and waits without a limit). A dead or stopped engine is found sooner, by health probes (about once a "
        "second, 5 s to answer; the router's of each replica, the launcher's of a role's one engine and of each "
        "router); failing them this long, a server is hung too: a replica is restarted (`replica_restarts`), a "
        "role's one engine or a router is stopped and the job ends naming it, or restarts whole with `max_failures`. "
        "Meanwhile the job is not silent: a role's one engine or a router that has not answered its probes for 5 s "
        "gets a line (`teacher server 0 has not answered its health check for 6 s ...`), and another when it "
        "answers again. Lower this to find sooner an "
        "engine that accepts but does not answer (stopped, deadlocked). Weight-transfer calls get the same limit.",
        minimum=MIN_TIMEOUT_S, maximum=MAX_SECONDS),
    Key("replica_restarts", "int", 3, "A role with several engine replicas (torchrun, or Ray): "
        "how often each replica that dies while the job runs is restarted on its own devices (a fresh port; on Ray a "
        "fresh actor and placement group on the same node; on several torchrun machines by the machine it ran on; "
        "the router takes it back once it answers), the job going "
        "on; a hung one (no answer within `request_timeout_s`, or failing its health probes that long) is stopped "
        "first (SIGTERM, then SIGKILL). Spent, or every other replica of the role dead or being restarted: the job "
        "ends naming the replica (or restarts whole with `max_failures`), as does any dead replica with `0`, and "
        "on several torchrun machines a hung replica of a machine other than 0 (machine 0 health-checks it). A "
        "restarted GRPO `rollout` replica on vLLM is held out of rotation until it "
        "holds the trainer's weights (it joins the weight-sync group at the next sync).",
        minimum=0, maximum=MAX_RESTARTS),
    Key("min_replicas", "int", None, "A separate role dualrun starts (torchrun, Ray): the fewest "
        "engine replicas the job goes on with. A replica that dies with its restarts spent (`replica_restarts`) or "
        "with its Ray node or its serving machine, or is scaled down (`dualrun scale`), leaves the router while at "
        "least this many remain; below, the job ends "
        "naming it (or restarts whole with `max_failures`). Unset: the planned count (`gpus / "
        "tensor_parallel_size`), as without the key. At most the planned count. On several torchrun machines the "
        "replicas above it must sit on serving machines (no ranks) that then are optional: see docs/fleets.md.",
        minimum=1,
        maximum=MAX_PROCESSES),
    Key("max_replicas", "int", None, "A separate role dualrun starts (torchrun, Ray): the most "
        "engine replicas `dualrun scale ROLE N` may grow it to; on Ray the role grows onto room the cluster gets, up "
        "to it (a spare with no free GPUs when the plan is made waits for a node with room); on several torchrun machines it grows as its optional serving machines are launched. The replicas "
        "above the planned count are spares, not started at launch (`dualrun plan` shows them); "
        "a router stands in front even of one. Unset: the planned count. Both keys are refused (unless equal to the "
        "planned count) on SLURM: not yet there.", minimum=1,
        maximum=MAX_PROCESSES),
    Key("server_args", "list", [], "Extra command-line arguments for the role's server, one word per item (a flag "
        "and its value are two items; only on a separate role dualrun starts a server for); not the flags dualrun "
        "sets itself (`--host`, "
        "`--port`, `--model`, `--tensor-parallel-size`, `--data-parallel-size`, in any "
        "spelling the server's parser takes, abbreviations included): exit 2. An `--api-key KEY` here is required "
        "on the inference endpoints by every replica (the CPU engine too) and by the router in front of them, and "
        "the trainers' requests carry it; its value is never printed."),
    Key("env", "dict", {}, "Extra environment for this role's processes."),
    Key("machines", "list", None, "torchrun: the machine ranks (0 .. num_machines-1) a role runs on, e.g. `[1]`. "
        "A separate role's engine replicas: each on the first of them with room, in the list's order (unset: "
        "machine 0 first, then 1, ...); without `torchrun.gpus_per_machine` (or CUDA_VISIBLE_DEVICES) the role's "
        "GPUs are assumed on the first machine listed; not beside `address` or `gpu_ids`. The trainers (the "
        "primary role, or a role colocated with it; colocated roles agree): the machines that run ranks, e.g. "
        "`[0]` (unset: every machine), holding machine 0, the ranks divided evenly over them; a machine left out "
        "only serves (its launcher starts no torchrun agent and ends with the job), and every machine must run "
        "ranks or servers. Not on Ray: exit 2.", backends="torchrun"),
)

# Keys that once promised an effect nothing delivers: refused with what to use instead.
REFUSED: dict[str, str] = {
    "sleep_level": "no `sleep_level` (TRL 1.16 always sleeps colocated vLLM at level 2; "
                   "`offload_model: true` turns sleep mode on)",
    "offload_teacher_model": "no `offload_teacher_model` (GKDTrainer keeps its teacher on its device; for "
                             "free trainer GPUs give `roles.teacher` GPUs of its own: a teacher server)",
}

SECTIONS: dict[str, tuple[Key, ...]] = {"": TOP_KEYS, "ray": RAY_KEYS, "torchrun": TORCHRUN_KEYS, "roles.<name>": ROLE_KEYS}

# Accelerate keys dualrun reads itself (their meaning is accelerate's); every other accelerate key is passed
# through to accelerate's own config loading and env preparation untouched.
ACCELERATE_TYPES: dict[str, str] = {
    "compute_environment": "str",
    "distributed_type": "str",
    "mixed_precision": "str-or-null",
    "use_cpu": "bool",
    "debug": "any",
    "num_processes": "int",
    "num_machines": "int",
    "machine_rank": "int",
    "main_process_ip": "str-or-null",
    "main_process_port": "int-or-null",
    "gpu_ids": "str-or-null",
    "rdzv_backend": "str-or-null",
    "same_network": "bool",
    "main_training_function": "str",
    "enable_cpu_affinity": "bool",
    "downcast_bf16": "any",
    "deepspeed_config": "dict",
    "fsdp_config": "dict",
    "fp8_config": "dict",
    "parallelism_config": "dict",
    "megatron_lm_config": "dict",
    "mpirun_config": "dict",
    "dynamo_config": "dict",
    "tpu_name": "str-or-null",
    "tpu_zone": "str-or-null",
    "tpu_use_cluster": "bool",
    "tpu_use_sudo": "bool",
    "tpu_env": "list",
    "command_file": "str-or-null",
    "commands": "list",
    "tpu_vm": "list",
    # legacy spellings accelerate still converts
    "fp16": "bool",
    "dynamo_backend": "str",
}
# What each accelerate key does under dualrun, where that is not simply accelerate's meaning (the reference lists it).
_NO_EFFECT = "accepted, no effect: accelerate reads it only for a TPU launch (dualrun launches torchrun or Ray)"
ACCELERATE_NOTES: dict[str, str] = {
    "num_machines": "torchrun: machines launched by hand; Ray: the planned node count; unset: 1, or the machines "
                    "the backend finds where it is launched (`Backend.machines_found`: SLURM's allocation's nodes)",
    "machine_rank": "torchrun only; Ray: refused unless 0 (Ray places the ranks across its nodes)",
    "main_process_ip": "torchrun: machine 0's address; Ray: no effect (Ray gives the ranks rank 0's address)",
    "main_process_port": "torchrun: machine 0's store; Ray: rank 0's MASTER_PORT (unset: a free port); one held by "
                         "another process is refused before anything starts (exit 2)",
    "gpu_ids": "torchrun: the trainers' devices; Ray: `all` or unset; CPU: no effect",
    "rdzv_backend": "`torchrun.rdzv_backend` where that is unset (static or c10d); Ray: no effect",
    "same_network": "accepted, no effect: dualrun gives torchrun machine 0's address itself",
    "main_training_function": _NO_EFFECT,
    "tpu_name": _NO_EFFECT, "tpu_zone": _NO_EFFECT, "tpu_use_cluster": _NO_EFFECT, "tpu_use_sudo": _NO_EFFECT,
    "tpu_env": _NO_EFFECT, "tpu_vm": _NO_EFFECT,
    "commands": "refused unless empty: `accelerate tpu-config` runs them; dualrun runs none",
    "command_file": "refused unless unset: `accelerate tpu-config` runs it; dualrun runs none",
    "mpirun_config": "refused unless empty: dualrun never launches mpirun",
}
# Bounds dualrun checks on accelerate's counts: (minimum, maximum).
ACCELERATE_BOUNDS: dict[str, tuple[int, int]] = {
    "num_processes": (1, MAX_PROCESSES),
    "num_machines": (1, MAX_MACHINES),
    "machine_rank": (0, MAX_MACHINES - 1),
    "main_process_port": (1, 65535),
}
ACCELERATE_CHOICES: dict[str, tuple] = {
    "compute_environment": ("LOCAL_MACHINE",),
    "distributed_type": ("NO", "MULTI_CPU", "MULTI_GPU", "DEEPSPEED", "FSDP", "MEGATRON_LM", "MULTI_XPU",
                         "MULTI_NPU", "MULTI_MLU", "MULTI_MUSA", "MULTI_HPU", "MULTI_SDAA", "MULTI_NEURON", "XLA"),
    "mixed_precision": ("no", "fp16", "bf16", "fp8"),
}

# ms-swift's role-group form, converted into `roles`.
SWIFT_KEY = "device_groups"


def all_top_level_names() -> list[str]:
    return [k.name for k in TOP_KEYS] + list(ACCELERATE_TYPES) + [SWIFT_KEY]
