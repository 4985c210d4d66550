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


def _doc_yaml(doc: str, heading: str) -> str:
    """The first ```yaml block under `heading` in README.md or docs/*.md."""
    import re

    section = (REPO / doc).read_text().split(heading + "\n", 1)[1]
    return re.search(r"```yaml\n(.*?)```", section, re.S).group(1)


@pytest.mark.parametrize("doc,heading", [("README.md", "## Config"), ("docs/concepts.md", "## Colocate vs separate")])
@pytest.mark.parametrize("colocated", [False, True])
def test_docs_main_config_example_plans_colocated_and_separate(tmp_path, doc, heading, colocated):
    """The docs' main config examples, as written and with the comment's other choice (colocated <-> separate)."""
    text = _doc_yaml(doc, heading)
    assert "colocate_groups:" in text
    lines = [l for l in text.splitlines() if not l.startswith("colocate_groups:")]
    if colocated:
        lines.append("colocate_groups: [[train, rollout]]")
    path = tmp_path / "example.yaml"
    path.write_text("\n".join(lines) + "\n")
    cfg = load_config(str(path), backend="torchrun")
    get_plugin(cfg.method, cfg.source).validate(cfg)
    table = make_plan(cfg).table()
    assert "rank 3  (world 4" in table
    assert ("rollout server" in table) != colocated, table


def test_migration_ms_swift_example_needs_only_the_method_line(tmp_path):
    """docs/migration.md's ms-swift file, side by side: the left column (ms-swift's own) is refused for want of
    `method:`; the right one (that line added) plans the groups as roles."""
    from dualrun.contract.errors import ConfigError

    text = _doc_yaml("docs/migration.md", "## From ms-swift `--use_ray true` / `device_groups`")
    rows = text.splitlines()[1:]
    width = rows[0].index("use_ray", 1)
    left, right = (tmp_path / "swift.yaml"), (tmp_path / "dualrun.yaml")
    left.write_text("\n".join(r[:width].rstrip() for r in rows if r[:width].strip()) + "\n")
    right.write_text("\n".join(r[width:] for r in rows if r[width:].strip()) + "\n")
    assert "method: sampling" in right.read_text() and "method" not in left.read_text()
    with pytest.raises(ConfigError, match="roles.sampler"):
        cfg = load_config(str(left), backend="torchrun")
        get_plugin(cfg.method, cfg.source).validate(cfg)
    cfg = load_config(str(right), backend="torchrun")
    get_plugin(cfg.method, cfg.source).validate(cfg)
    roles = {r.name: r.gpus for r in cfg.roles}
    assert cfg.method == "sampling" and roles == {"sampler": 2, "prm": 2, "orm": 2}, roles
    assert ["prm", "orm"] in [list(g) for g in cfg.colocate_groups], cfg.colocate_groups
