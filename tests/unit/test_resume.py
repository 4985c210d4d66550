"""Restart hooks: only on a restart; the agent store's keys are scoped per attempt (torch's static rendezvous
reuses one store across restarts)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

CODE = """
from dualrun.rank.resume import activate; activate()
import sys, torch.distributed
r = sys.modules['torch.distributed.rendezvous']
print(getattr(r._create_c10d_store, '_dualrun', False))
"""


def _patched(**env: str) -> str:
    full = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    full.update(env)
    out = subprocess.run([sys.executable, "-c", CODE], env=full, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.slow
def test_store_keys_scoped_on_restart_only():
    assert _patched(TORCHELASTIC_RESTART_COUNT="1", TORCHELASTIC_USE_AGENT_STORE="True") == "True"
    assert _patched(TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_USE_AGENT_STORE="True") == "False"
    assert _patched(TORCHELASTIC_RESTART_COUNT="2", TORCHELASTIC_USE_AGENT_STORE="False") == "False"


def test_an_unfinished_checkpoint_is_never_resumed_from(tmp_path):
    """A rank killed while rank 0 saved leaves checkpoint-N without trainer_state.json (written last)."""
    from dualrun.rank.resume import last_complete_checkpoint

    assert last_complete_checkpoint(str(tmp_path)) is None
    for step, complete in ((10, True), (20, True), (30, False)):
        (tmp_path / f"checkpoint-{step}").mkdir()
        if complete:
            (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-x").mkdir()
    assert last_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-20")
