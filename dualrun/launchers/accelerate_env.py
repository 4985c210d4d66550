"""The ACCELERATE_* / FSDP_* / DeepSpeed variables `accelerate launch` would export for a config.

Computed by accelerate itself (its launch parser, validation and env preparation), so both backends
export exactly what `accelerate launch` would. Imports accelerate (and torch) lazily: only launching needs it.
"""
from __future__ import annotations

import logging
import os
import sys
import tempfile
import warnings
from typing import TYPE_CHECKING, Mapping

from dualrun.contract import protocol

if TYPE_CHECKING:
    from dualrun.config.model import JobConfig

# Decided by dualrun's plan per backend, not taken from accelerate.
_PLAN_OWNED = {"MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS"}


def accelerate_env(cfg: JobConfig, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Variables accelerate adds for `cfg` (only the ones it adds or changes)."""
    import yaml
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import launch as acc_launch

    before = dict(os.environ if environ is None else environ)
    data = {k: v for k, v in cfg.accelerate.items()}
    data.setdefault("compute_environment", "LOCAL_MACHINE")
    # dualrun always launches through torchrun; accelerate must not try mpirun or its own port logic.
    data["main_process_port"] = 1
    data.pop("main_process_ip", None)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(data, f)
        path = f.name
    try:
        argv = ["--config_file", path, "--num_processes", str(cfg.num_processes),
                "--num_machines", str(cfg.num_machines), "--machine_rank", str(cfg.machine_rank),
                "--main_process_ip", "127.0.0.1", "dualrun_placeholder.py"]
        parser = launch_command_parser()
        args = parser.parse_args(argv)
        # accelerate reports defaults through logging and warnings only (no prints): silence those, and nothing
        # process-wide like sys.stdout, since this may run in a thread while the launcher connects to Ray.
        logger = logging.getLogger("accelerate.commands.launch")
        level = logger.level
        logger.setLevel(logging.ERROR)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                args, defaults, mp_from_config = _validate_launch_command(args)
                if args.use_deepspeed:
                    fields = list(defaults.deepspeed_config.keys()) if defaults else []
                    if mp_from_config:
                        fields.append("mixed_precision")
                    args.deepspeed_fields_from_accelerate_config = ",".join(fields)
                    args.deepspeed_multinode_launcher = "standard"
                    _, env = acc_launch.prepare_deepspeed_cmd_env(args)
                else:
                    env = acc_launch.prepare_multi_gpu_env(args)
        finally:
            logger.setLevel(level)
    finally:
        os.unlink(path)
    env["ACCELERATE_USE_CPU"] = str(bool(args.cpu or args.use_cpu or cfg.use_cpu))
    return {k: str(v) for k, v in env.items() if k not in _PLAN_OWNED and before.get(k) != v}


# -- cache -------------------------------------------------------------------------------------------------------
# Importing accelerate imports torch (2-3 s, ~200 MiB) in the driver, which a Ray launch otherwise never needs.
# The result depends only on the versions, the config's accelerate keys, the process counts, a few inherited
# variables and (DeepSpeed only) the working directory, so it is cached on disk (DUALRUN_CACHE=0 turns the cache off).
_ENV_PREFIXES = ("ACCELERATE_", "FSDP_", "MEGATRON_", "OMP_", "KMP_", "MKL_", "PYTHONPATH", "DS_", "CUDA_", "NCCL_")


def _reads_cwd(cfg: JobConfig) -> bool:
    """Whether accelerate's env for `cfg` holds the working directory: only its DeepSpeed path does (it puts the
    directory on PYTHONPATH). Told conservatively, by any accelerate key or value naming DeepSpeed; the rest is
    shared by every directory (a dry run or launch from a new one need not import torch)."""
    return any("deepspeed" in f"{k} {v}".lower() for k, v in cfg.accelerate.items())


def _installed_stamp() -> list[tuple[str, int]]:
    """What changes whenever a package is installed, upgraded or removed: the modification time of every
    site-packages directory on sys.path (each holds one `<name>-<version>.dist-info` per package). Cheaper than
    asking importlib.metadata for accelerate's, DeepSpeed's and torch's versions (~20 ms with its import, on every
    launch); it also drops the cache after unrelated installs, which costs one recomputation (2-3 s)."""
    out = []
    for p in sys.path:
        if p.endswith(("site-packages", "dist-packages")):
            try:
                out.append((p, os.stat(p).st_mtime_ns))
            except OSError:
                pass
    return out


def _cache_path(cfg: JobConfig, environ: Mapping[str, str]) -> str | None:
    import hashlib
    import json

    if environ.get(protocol.CACHE, "1") == "0":
        return None

    from dualrun import __version__

    key = json.dumps({
        "v": [__version__, _installed_stamp()],
        "acc": dict(cfg.accelerate), "n": [cfg.num_processes, cfg.num_machines, cfg.machine_rank, cfg.use_cpu],
        "cwd": os.getcwd() if _reads_cwd(cfg) else None,
        "env": sorted((k, v) for k, v in environ.items() if k.startswith(_ENV_PREFIXES)),
    }, sort_keys=True, default=str)
    root = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "dualrun", "accelerate-env", hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")


def cached_accelerate_env(cfg: JobConfig, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """`accelerate_env`, from the on-disk cache when this exact setup was computed before."""
    import json

    environ = os.environ if environ is None else environ
    path = _cache_path(cfg, environ)
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                return dict(json.load(f))
        except (OSError, ValueError):
            pass
    env = accelerate_env(cfg, environ)
    if path is not None:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(env, f)
            os.replace(tmp, path)
        except OSError:
            pass
    return env
