"""The bad-input corpus (tests/bad_inputs.yaml) through the real CLI: exit 2, one line naming the key, no
traceback, and nothing started (the script would leave a marker file; no `PWNED` file from an eval either)."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from conftest import dualrun

CASES = yaml.safe_load((Path(__file__).parent / "bad_inputs.yaml").read_text())
SCRIPT = "import pathlib; pathlib.Path('STARTED').write_text('yes')\n"


def test_corpus_is_big_enough():
    assert len(CASES) >= 25


@pytest.mark.parametrize("case", CASES, ids=[f"{i}-{c['key']}" for i, c in enumerate(CASES)])
def test_bad_input(tmp_path, case):
    (tmp_path / "train.py").write_text(SCRIPT)
    args = ["launch"]
    if case.get("config") is not None:
        (tmp_path / "bad.yaml").write_text(case["config"])
        args += ["--config_file", "bad.yaml"]
    args += case.get("args", []) + [case.get("script", "train.py")]
    proc = dualrun(*args, cwd=tmp_path, timeout=60)
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f": {case['key']}: expected" in lines[0], lines[0]
    if "hint" in case:
        assert case["hint"] in lines[0]
    assert not (tmp_path / "STARTED").exists() and not (tmp_path / "PWNED").exists()
    assert proc.stdout == ""
