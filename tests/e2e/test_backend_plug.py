"""A backend from another distribution is a plug: a tiny package with an entry point in the group
`dualrun.backends`, made here on disk (no change to dualrun/), is listed, planned and launched by `--backend NAME`;
an unknown name, or a registered backend that does not load, is one line naming the installed ones."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import dualrun

# The out-of-tree backend: torchrun's launcher under another name and record (each machine launched by hand, its
# groups local), as a site's wrapper around torchrun would be.
PACKAGE = '''
from dualrun.backends.torchrun import TorchrunBackend
from dualrun.config.backends import BackendKind
from dualrun.plan.placement import MachinesPlacement


class SiteBackend(TorchrunBackend):
    kind = BackendKind("site", per_machine=True, ray=False, groups="local", placement=MachinesPlacement)
    output = "output of every rank on this terminal (the site backend)"


BACKEND = SiteBackend()
'''

SCRIPT = """
import json, os, sys
with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump({k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}, f)
"""


def _distribution(root: Path, broken: bool = False) -> dict[str, str]:
    """`site_backend` and its dist-info (what `pip install` of a one-module package leaves), on PYTHONPATH."""
    root.mkdir(exist_ok=True)
    (root / "site_backend.py").write_text("raise ImportError('a missing dependency')\n" if broken else PACKAGE)
    info = root / "site_backend-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: site-backend\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[dualrun.backends]\nsite = site_backend:BACKEND\n")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}


def test_an_unknown_backend_is_one_line_naming_the_installed_ones(tmp_path):
    (tmp_path / "c.yaml").write_text("use_cpu: true\n")
    env = _distribution(tmp_path / "dist")
    r = dualrun("plan", "--config_file", "c.yaml", "--backend", "nope", cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    listed = subprocess.run([sys.executable, "-c", "from dualrun.config.backends import installed; "
                             "print(', '.join(installed()))"], capture_output=True, text=True,
                            env={**os.environ, **env}, cwd=tmp_path).stdout.strip()
    assert listed.startswith("torchrun, ray, ") and "site" in listed.split(", "), listed   # every installed one
    assert f"--backend: expected one of {listed} (the installed backends), got nope" in r.stderr, r.stderr


def test_a_backend_that_does_not_load_is_named_when_asked_for(tmp_path):
    (tmp_path / "c.yaml").write_text("use_cpu: true\nbackend: site\n")
    env = _distribution(tmp_path / "dist", broken=True)
    r = dualrun("plan", "--config_file", "c.yaml", cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "backend 'site' is installed but does not load: ImportError: a missing dependency)" in r.stderr
    ok = dualrun("plan", "--config_file", "c.yaml", "--backend", "torchrun", cwd=tmp_path, env=env, timeout=120)
    assert ok.returncode == 0, ok.stderr   # the others are not held up by it


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_out_of_tree_backend_is_picked_by_its_name(tmp_path):
    env = _distribution(tmp_path / "dist")
    (tmp_path / "c.yaml").write_text("use_cpu: true\nroles: {train: {gpus: 2}}\n")
    (tmp_path / "w.py").write_text(SCRIPT)
    (tmp_path / "out").mkdir()
    plan = dualrun("plan", "--config_file", "c.yaml", "--backend", "site", "--json", cwd=tmp_path, env=env,
                   timeout=120)
    if plan.returncode == 2 and "--json" in plan.stderr:   # no JSON form: the table
        plan = dualrun("plan", "--config_file", "c.yaml", "--backend", "site", cwd=tmp_path, env=env, timeout=120)
    assert plan.returncode == 0 and "site" in plan.stdout, plan.stdout + plan.stderr
    r = dualrun("launch", "--backend", "site", "--config_file", "c.yaml", "w.py", str(tmp_path / "out"),
                cwd=tmp_path, env=env, timeout=200)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "the site backend" in r.stdout + r.stderr
    ranks = [json.loads((tmp_path / "out" / f"rank{i}.json").read_text()) for i in range(2)]
    assert [(x["RANK"], x["WORLD_SIZE"]) for x in ranks] == [("0", "2"), ("1", "2")]
