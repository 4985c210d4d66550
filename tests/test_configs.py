"""Every shipped config validates and plans (the GPU ones on the GPUs they ask for)."""
from __future__ import annotations

import pytest

from dualrun.config import load_config
from dualrun.plan.processes import make_plan
from dualrun.methods.plugin import get_plugin
from helpers import REPO

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
@pytest.mark.parametrize("backend", ["torchrun", "ray"])
def test_shipped_config_is_valid(path, backend):
    cfg = load_config(str(path), backend=backend)
    get_plugin(cfg.method, cfg.source).validate(cfg)
    plan = make_plan(cfg)
    assert plan.workers and all(p.env["DUALRUN_METHOD"] == cfg.method for p in plan.processes)
