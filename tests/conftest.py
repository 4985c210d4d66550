"""Shared test helpers. Tests that start torchrun or Ray need a loopback-only network namespace
(`unshare -n` + `ip link set lo up`, as .ci/run does); elsewhere they are skipped with that reason."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def loopback_only() -> bool:
    try:  # /proc/net/dev lists the interfaces of this process's network namespace
        with open("/proc/net/dev") as f:
            names = {line.split(":")[0].strip() for line in f.readlines()[2:]}
        return names <= {"lo"}
    except OSError:
        return False


def pytest_collection_modifyitems(config, items):
    # Under pytest-xdist (`--dist loadgroup`, scripts/test.sh) the slow end-to-end tests stay on one worker, one at a
    # time as without xdist: two Ray clusters starting at once on 2 cores can time out. The rest runs beside them.
    serial = pytest.mark.xdist_group("slow-e2e")
    for item in items:
        if "e2e" in item.keywords and "slow" in item.keywords:
            item.add_marker(serial)
    if loopback_only() or os.environ.get("DUALRUN_TEST_ANY_NETWORK") == "1":
        return
    skip = pytest.mark.skip(reason="starts torchrun/Ray: run inside `unshare -n` with lo up (see README)")
    for item in items:
        if "e2e" in item.keywords:
            item.add_marker(skip)


def dualrun(*args: str, cwd: str | Path | None = None, timeout: float = 240, env: dict | None = None,
            input: str | None = None) -> subprocess.CompletedProcess:
    """Run the real CLI in a fresh interpreter, as a user would."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "dualrun", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=full_env, input=input)


@pytest.fixture(scope="session")
def tiny() -> Path:
    """The tiny model, teacher, tokenizer and datasets (examples/make_tiny_model.py), built once for the whole run
    (cached by the builder's content: see helpers.tiny_assets). Read-only: a test that needs the files under its own
    path (a leftover marker, a relative `tiny/...`) links them with `link_tiny`."""
    from helpers import tiny_assets

    return tiny_assets()


def link_tiny(tiny: Path, where: Path) -> Path:
    """`where/tiny` -> the shared assets: paths under the test's own directory (unique markers on the workers'
    command lines, relative `tiny/model` arguments) without building or copying anything."""
    link = where / "tiny"
    if not link.exists():
        link.symlink_to(tiny, target_is_directory=True)
    return link


@pytest.fixture
def write(tmp_path):
    """write('name.yaml', text) -> path"""

    def _write(name: str, text: str) -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    return _write
