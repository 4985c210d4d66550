"""`pip install .` builds a complete wheel: every subpackage (the built-in plugins from `plugins/` as
`dualrun.plugins`), the `dualrun` console script, and one version number everywhere.

The wheel is built offline (`pip wheel --no-deps --no-build-isolation`) from a copy of the source tree, so the
checkout gets no `build/` folder."""
from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from helpers import REPO

pytestmark = pytest.mark.timeout(240)

SKIP = shutil.ignore_patterns(".git", ".venv*", "venv", "build", "dist", "*.egg-info", "__pycache__",   # .venv-vllm too
                              ".pytest_cache", "runs", "tiny", ".whl", ".gl")

MUST_HAVE = ["dualrun/__init__.py", "dualrun/cli.py", "dualrun/rank/bootstrap.py", "dualrun/config/schema.py",
             "dualrun/plugins/__init__.py", "dualrun/plugins/sft.py", "dualrun/plugins/grpo.py",
             "dualrun/plugins/gkd.py", "dualrun/plugins/sampling.py", "dualrun/plugins/workers/grpo_worker.py",
             "dualrun/plugins/workers/gkd_worker.py", "dualrun/backends/ray/actor_launcher.py",
             "dualrun/backends/ray/actors/rank_actor.py", "dualrun/backends/torchrun/agent_launcher.py"]
MUST_HAVE_DIRS = ["dualrun/servers/", "dualrun/programs/", "dualrun/light/", "dualrun/role_programs/",
                  "dualrun/launchers/", "dualrun/config/", "dualrun/plugins/", "dualrun/weightsync/engine/",
                  "dualrun/backends/ray/actors/"]


def _pyproject() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    return tomllib.loads((REPO / "pyproject.toml").read_text())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(REPO, src, ignore=SKIP)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-q", "-w", str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    wheels = list((tmp / "dist").glob("dualrun-*.whl"))
    assert len(wheels) == 1, wheels
    with zipfile.ZipFile(wheels[0]) as zf:
        yield zf


def _package_dirs(root: Path, prefix: str) -> set[str]:
    """Every folder with an __init__.py under `root`, as a dotted name under `prefix`."""
    return {".".join([prefix, *p.parent.relative_to(root).parts]) for p in root.rglob("__init__.py")
            if "__pycache__" not in p.parts}


def test_wheel_has_every_module(wheel):
    names = set(wheel.namelist())
    missing = [n for n in MUST_HAVE if n not in names]
    assert not missing, missing
    for d in MUST_HAVE_DIRS:
        assert any(n.startswith(d) and n.endswith(".py") for n in names), d
    # every .py of the source tree is in the wheel (a new subpackage missing from [tool.setuptools] packages
    # would be silently dropped)
    source = {f"dualrun/{p.relative_to(REPO / 'dualrun').as_posix()}" for p in (REPO / "dualrun").rglob("*.py")}
    source |= {f"dualrun/plugins/{p.relative_to(REPO / 'plugins').as_posix()}" for p in (REPO / "plugins").rglob("*.py")}
    source = {s for s in source if "__pycache__" not in s}
    assert sorted(source - names) == []


def test_pyproject_lists_every_package():
    declared = set(_pyproject()["tool"]["setuptools"]["packages"])
    found = _package_dirs(REPO / "dualrun", "dualrun") | _package_dirs(REPO / "plugins", "dualrun.plugins")
    assert sorted(found - declared) == [], "add these to [tool.setuptools] packages in pyproject.toml"


def test_console_script_and_version(wheel):
    import dualrun

    dist_info = next(n.split("/")[0] for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    eps = configparser.ConfigParser()
    eps.read_string(wheel.read(f"{dist_info}/entry_points.txt").decode())
    assert eps["console_scripts"]["dualrun"] == "dualrun.cli:entry"
    metadata = wheel.read(f"{dist_info}/METADATA").decode()
    version = next(line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Version:"))
    assert version == dualrun.__version__ == _pyproject()["project"]["version"]
    assert dist_info == f"dualrun-{version}.dist-info"
    # the version in the wheel's own dualrun/__init__.py too (what an installed copy reports)
    assert f'__version__ = "{version}"' in wheel.read("dualrun/__init__.py").decode()
    # the console script's target exists
    from dualrun.cli import entry

    assert callable(entry)
