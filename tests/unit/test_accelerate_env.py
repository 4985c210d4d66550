"""accelerate's own env preparation, and its on-disk cache (so a Ray driver need not import torch)."""
from __future__ import annotations

import os
import subprocess
import sys

from dualrun.launchers.accelerate_env import accelerate_env, cached_accelerate_env
from dualrun.config import build_config


def test_env_is_what_accelerate_exports():
    cfg = build_config({"distributed_type": "FSDP", "mixed_precision": "bf16", "num_processes": 2,
                        "fsdp_config": {"fsdp_version": 2, "fsdp_offload_params": True}}, "x.yaml")
    env = accelerate_env(cfg, {})
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
    assert env["FSDP_OFFLOAD_PARAMS"] == "true" and env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert "MASTER_PORT" not in env and "CUDA_VISIBLE_DEVICES" not in env  # the plan owns those


def test_cache_gives_the_same_env_without_importing_torch(tmp_path):
    cfg = build_config({"use_cpu": True, "roles": {"train": {"gpus": 2}}}, "x.yaml")
    environ = {"XDG_CACHE_HOME": str(tmp_path)}
    first = cached_accelerate_env(cfg, environ)
    assert first == accelerate_env(cfg, environ)
    assert list(tmp_path.glob("dualrun/accelerate-env/*.json"))
    code = ("import sys, os; from dualrun.config import build_config; "
            "from dualrun.launchers.accelerate_env import cached_accelerate_env; "
            "cfg = build_config({'use_cpu': True, 'roles': {'train': {'gpus': 2}}}, 'x.yaml'); "
            f"env = cached_accelerate_env(cfg, {{'XDG_CACHE_HOME': {str(tmp_path)!r}}}); "
            "print(env['ACCELERATE_USE_CPU'], 'torch' in sys.modules, 'accelerate' in sys.modules, "
            "'importlib.metadata' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    # a hit reads no package metadata either (~20 ms of every launch)
    assert out.stdout.split() == ["True", "False", "False", "False"], out.stderr


def test_an_install_or_upgrade_in_site_packages_computes_the_env_again(tmp_path, monkeypatch):
    site = tmp_path / "lib" / "site-packages"
    (site / "accelerate-1.0.0.dist-info").mkdir(parents=True)
    monkeypatch.syspath_prepend(str(site))
    cfg = build_config({"use_cpu": True}, "x.yaml")
    environ = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    entries = lambda: sorted((tmp_path / "cache").glob("dualrun/accelerate-env/*.json"))  # noqa: E731
    cached_accelerate_env(cfg, environ)
    cached_accelerate_env(cfg, environ)
    assert len(entries()) == 1
    (site / "accelerate-1.0.0.dist-info").rename(site / "accelerate-2.0.0.dist-info")   # what pip's upgrade does
    os.utime(site, ns=(1, 1))   # the rename's mtime may fall in the same clock tick: make the change certain
    cached_accelerate_env(cfg, environ)
    assert len(entries()) == 2


def test_cache_can_be_turned_off(tmp_path):
    cfg = build_config({"use_cpu": True}, "x.yaml")
    cached_accelerate_env(cfg, {"XDG_CACHE_HOME": str(tmp_path), "DUALRUN_CACHE": "0"})
    assert not list(tmp_path.glob("dualrun/**/*.json"))


def test_one_cache_entry_serves_every_directory_unless_deepspeed_puts_it_on_the_path(tmp_path, monkeypatch):
    """accelerate's DeepSpeed env holds the working directory (on PYTHONPATH), the others none: a dry run or launch
    from a new directory reuses the entry, a DeepSpeed one gets its own."""
    cache = tmp_path / "cache"
    environ = {"XDG_CACHE_HOME": str(cache)}
    plain = build_config({"use_cpu": True, "roles": {"train": {"gpus": 2}}}, "x.yaml")
    zero2 = build_config({"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 2}, "num_processes": 2,
                          "use_cpu": True}, "x.yaml")
    envs = {}
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        monkeypatch.chdir(tmp_path / name)
        assert str(tmp_path / name) not in cached_accelerate_env(plain, environ).values()
        envs[name] = cached_accelerate_env(zero2, environ)
        assert str(tmp_path / name) in envs[name]["PYTHONPATH"].split(os.pathsep)
    assert len(list(cache.glob("dualrun/accelerate-env/*.json"))) == 3   # plain once, DeepSpeed per directory
