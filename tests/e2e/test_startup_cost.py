"""What a launch pays before the first rank starts: the Ray worker side imports nothing of the driver's,
and a torchrun launch with accelerate's env cached imports no accelerate in the driver (its agent needs torch,
as bare torchrun's does, but nothing more)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import REPO

_DRIVER_SIDE = ("dualrun.launchers.launcher", "dualrun.config", "dualrun.plan.processes", "dualrun.servers", "torch", "accelerate")


def _modules_after(code: str, env: dict | None = None, cwd=None) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport json, sys; print(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, timeout=120, env=env, cwd=cwd)
    assert out.returncode == 0, out.stderr[-2000:]
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_a_rank_actor_imports_nothing_of_the_driver():
    """Every rank actor's Ray worker imports dualrun.backends.ray.actors.rank_actor: the package must not pull the launcher
    base (config, plan, servers: about 0.25 s a process on 2 cores)."""
    mods = _modules_after("import dualrun.backends.ray.actors.rank_actor")
    assert not [m for m in mods if m.startswith(_DRIVER_SIDE)]


def test_the_launchers_package_still_exports_its_names():
    from dualrun.backends import backend_of
    from dualrun.launchers import JobResult, Launcher, Program, RankResult
    from dualrun.launchers import launcher as base

    assert (JobResult, Launcher, Program, RankResult) == (base.JobResult, base.Launcher, base.Program,
                                                          base.RankResult)
    assert backend_of("torchrun").launcher_class().name == "torchrun"   # each backend hands out its launcher
    assert backend_of("ray").launcher_class().name == "ray"
    with pytest.raises(AttributeError):
        import dualrun.launchers as pkg

        pkg.NoSuchName  # noqa: B018


def test_only_env_is_exactly_the_jobs_env_inside_and_ours_after(monkeypatch):
    from dualrun.backends.torchrun.agent_launcher import _only_env

    monkeypatch.setenv("DUALRUN_TEST_OURS", "1")
    before = dict(os.environ)
    with pytest.raises(RuntimeError):
        with _only_env({"JOB": "x"}):
            assert dict(os.environ) == {"JOB": "x"}
            os.environ["ADDED"] = "y"
            raise RuntimeError("the agent failed")
    assert dict(os.environ) == before


@pytest.mark.e2e
@pytest.mark.timeout(120)
@pytest.mark.slow
def test_a_torchrun_launch_with_a_cached_env_imports_no_accelerate(tmp_path):
    from helpers import loopback_only

    if not loopback_only():
        pytest.skip("starts torchrun: run inside scripts/in-loopback.sh")
    script = tmp_path / "rank.py"
    script.write_text("import os\n")
    (tmp_path / "cfg.yaml").write_text("use_cpu: true\nroles: {train: {gpus: 2}}\n")
    probe = (f"import atexit, sys, runpy\n"
             f"atexit.register(lambda: open({str(tmp_path / 'mods.json')!r}, 'w').write("
             f"__import__('json').dumps(sorted(sys.modules))))\n"
             f"sys.argv = ['dualrun', 'launch', '--backend', 'torchrun', '--config_file', 'cfg.yaml', 'rank.py']\n"
             f"runpy.run_module('dualrun', run_name='__main__')\n")
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), PYTHONPATH=str(REPO))
    dry = subprocess.run([sys.executable, "-m", "dualrun", "launch", "--dry_run", "--backend", "torchrun",
                          "--config_file", "cfg.yaml", "rank.py"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=100)   # fills the cache, as a first launch of this config would
    assert dry.returncode == 0, dry.stderr[-2000:]
    r = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=100)
    assert r.returncode == 0, r.stderr[-2000:]
    mods = json.loads((tmp_path / "mods.json").read_text())
    assert "torch.distributed.run" in mods            # the agent ran in the driver, as under bare torchrun
    assert not [m for m in mods if m == "accelerate" or m.startswith("accelerate.")]


def test_the_launch_path_reads_no_package_metadata_and_imports_no_role_api(tmp_path):
    """What stays off the path to torchrun's agent: package metadata
    (importlib.metadata, ~17 ms to import), urllib (~14 ms), the role-splitting API (~15 ms). A dry run with the
    config's accelerate env cached takes the same path up to the agent."""
    (tmp_path / "rank.py").write_text("import os\n")
    (tmp_path / "cfg.yaml").write_text("use_cpu: true\nroles: {train: {gpus: 2}}\n")
    argv = ["dualrun", "launch", "--dry_run", "--backend", "torchrun", "--config_file", "cfg.yaml", "rank.py"]
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), PYTHONPATH=str(REPO))
    first = subprocess.run([sys.executable, "-m", *argv], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=100)   # fills the cache, as a first launch of this config would
    assert first.returncode == 0, first.stderr[-2000:]
    probe = (f"import atexit, json, runpy, sys\n"
             f"atexit.register(lambda: open({str(tmp_path / 'mods.json')!r}, 'w').write(json.dumps(sorted(sys.modules))))\n"
             f"sys.argv = {argv!r}\n"
             f"runpy.run_module('dualrun', run_name='__main__')\n")
    r = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=100)
    assert r.returncode == 0, r.stderr[-2000:]
    mods = set(json.loads((tmp_path / "mods.json").read_text()))
    assert "dualrun.plan.processes" in mods and "dualrun.role_programs.driver" in mods   # the path was taken
    assert not mods & {"importlib.metadata", "urllib.request", "dualrun.role_programs.decorators",
                       "dualrun.role_programs.group", "torch", "accelerate"}, \
        sorted(mods & {"importlib.metadata", "urllib.request"})
