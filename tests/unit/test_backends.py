"""The backend as an object: each hands out its launcher, the cluster `dualrun plan` places onto, its checks and
`dualrun check`'s look at its nodes; what the layers below need is its record (config/backends.py), and the name
is compared nowhere else."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from helpers import REPO
from dualrun.backends import backend_of
from dualrun.config import build_config
from dualrun.backends.ray.packing import RayPlacement
from dualrun.config.backends import installed, kind_of
from dualrun.plan.placement import MachinesPlacement, placement_for
from dualrun.role_programs.driver import roles_mode
from dualrun.backends.ray.actor_groups import RAY_GROUPS
from dualrun.role_programs.modes import LOCAL_GROUPS, groups_table, mode_of
from dualrun.role_programs.spec import GroupSpec, RolesSpec

TORCHRUN, RAY = kind_of("torchrun"), kind_of("ray")
NAMES = set(installed())
# The weight-sync group's host and devices (weightsync/sync_group.py) still read the name: its package moves alone.
STILL_BY_NAME: set[str] = set()


def by_name(source: str) -> list[int]:
    """Lines where `source` compares something with a backend's name (`x == "ray"`, `"torchrun" != y`,
    `x in ("torchrun", ...)`)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            items = [e for side in sides for e in (side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set))
                                                   else [side])]
            texts = {e.value for e in items if isinstance(e, ast.Constant) and isinstance(e.value, str)}
            if texts & NAMES:
                lines.append(node.lineno)
    return lines


def test_the_scan_sees_a_comparison_with_a_backends_name():
    assert by_name("a = cfg.backend == 'ray'\nb = 'torchrun' != x\nc = y in ('ray', 'z')\nd = {'ray': 1}\n"
                   "e = find_spec('ray') is not None\n") == [1, 2, 3]   # a package named ray is no backend


def test_the_name_is_looked_up_in_one_place():
    sources = [p for root in (REPO / "dualrun", REPO / "plugins") for p in sorted(root.rglob("*.py"))]
    assert len(sources) > 100, "the scan found too little: it is broken"
    found = {str(p.relative_to(REPO)): by_name(p.read_text()) for p in sources}
    assert set(path for path, lines in found.items() if lines) <= STILL_BY_NAME


def test_each_backend_hands_out_its_launcher_and_its_record():
    torchrun, ray = backend_of("torchrun"), backend_of("ray")
    assert (torchrun.kind, ray.kind) == (TORCHRUN, RAY) and (torchrun.name, ray.name) == ("torchrun", "ray")
    assert torchrun.launcher_class().name == "torchrun" and ray.launcher_class().name == "ray"
    assert not torchrun.plans_live and ray.plans_live
    cfg = build_config({"backend": "ray", "use_cpu": True}, "c.yaml")
    assert backend_of(cfg).kind is RAY and cfg.backend_kind is kind_of("ray")
    with pytest.raises(KeyError):
        kind_of("kubernetes")


def test_the_layers_below_read_the_record():
    torchrun = build_config({"use_cpu": True}, "c.yaml")
    ray = build_config({"backend": "ray", "use_cpu": True}, "c.yaml")
    assert isinstance(placement_for(torchrun), MachinesPlacement) and isinstance(placement_for(ray), RayPlacement)
    assert (roles_mode(torchrun), roles_mode(ray)) == ("local", "ray")
    assert TORCHRUN.files_here(torchrun) and not RAY.files_here(ray)   # a joined cluster's nodes have their own
    assert RAY.files_here(build_config({"backend": "ray", "ray": {"address": "local"}}, "c.yaml"))


def test_a_role_programs_groups_run_in_the_mode_its_backend_names():
    assert mode_of("ray") is RAY_GROUPS and mode_of("torchrun") is mode_of("python") is LOCAL_GROUPS
    assert RAY_GROUPS.spread and not LOCAL_GROUPS.spread
    with pytest.raises(ValueError, match=r"backend='kubernetes': expected one of \["):
        mode_of("kubernetes")
    spec = RolesSpec((GroupSpec("actor", 2, 2, ("actor",), devices=(3, 4)), GroupSpec("critic", 1, 0, ("critic",))))
    assert groups_table(spec, "ray").splitlines() == [
        "role program: runs once, as the Ray driver on this machine; groups: each worker a Ray actor on its role's "
        "devices",
        "  actor      2 worker(s), 2 GPU(s), one per worker", "  critic     1 worker(s), CPU"]
    assert groups_table(spec, "local").splitlines()[1:] == ["  actor      2 worker(s), GPU 3,4",
                                                            "  critic     1 worker(s), CPU"]
