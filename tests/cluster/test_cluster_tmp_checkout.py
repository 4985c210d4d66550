"""The cluster tier from a checkout under /tmp: each machine of tests/support/vcluster.py has a /tmp of its own, which
would hide a checkout there and its venv (`vcluster: /tmp/.../.venv/bin/python: No such file or directory` on every
machine); vcluster binds them back in at the same path (`vcluster.image`).

Here: this tree copied under /tmp (its files as git lists them, uncommitted changes included), a venv of its own
there (no pip: a .pth puts the copy and this venv's packages on its path, so its `dualrun` is the copy's), and the
tier's smallest job across two machines run from the copy with that venv's python by a pytest of its own:
`dualrun check` on both machines, which forms the trainer's weight-sync group across them. The copy goes
afterwards; the cluster leaves nothing (VCluster.close)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
SMALLEST = ("tests/cluster/test_cluster_check.py::"
            "test_two_sound_machines_pass_and_form_the_weight_sync_group_across_them")


def copy_tree(dest: Path) -> None:
    """The files of this checkout (tracked and untracked, not ignored: no venv, no build output), at `dest`."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if not os.path.lexists(source) or source.is_dir():   # deleted, or a submodule
            continue
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, dest / name, follow_symlinks=False)


def make_venv(checkout: Path) -> Path:
    """checkout/.venv: a venv under /tmp whose path holds the copy, then this venv's packages; its python."""
    venv = checkout / ".venv"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(venv)],
                   check=True, capture_output=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    # plain lines: this venv's own .pth files (its editable install of the other checkout) are not run
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(purelib, "dualrun-outer.pth").write_text("\n".join([str(checkout), *sorted(ours)]) + "\n")
    (checkout / "dualrun" / "plugins").symlink_to("../plugins")   # pyproject's package-dir, as an install maps it
    return python


@pytest.fixture
def checkout():
    where = Path(tempfile.mkdtemp(prefix="dualrun-checkout-", dir="/tmp"))
    try:
        copy_tree(where)
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


def test_the_smallest_cluster_job_runs_from_a_checkout_and_venv_under_tmp(checkout):
    python = make_venv(checkout)
    found = subprocess.run([str(python), "-c", "import dualrun; print(dualrun.__file__)"], capture_output=True,
                           text=True, cwd="/", check=True).stdout.strip()
    assert found == str(checkout / "dualrun" / "__init__.py")   # the copy's, not this checkout's
    env = {**os.environ, "DUALRUN_CLUSTER_TIER": "1", "VIRTUAL_ENV": str(python.parents[1]),
           "PATH": f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                           "--basetemp", str(checkout / ".pytest-tmp"), SMALLEST], cwd=checkout, env=env,
                          capture_output=True, text=True, timeout=540)
    out = proc.stdout + proc.stderr
    assert "No such file or directory" not in out, out[-3000:]
    assert proc.returncode == 0 and "1 passed" in out, out[-3000:]
