"""The driver-worker protocol: every DUALRUN_* name lives in dualrun/contract/protocol.py; settings survive the trip."""
from __future__ import annotations

import ast
import json
import subprocess
import sys

from dualrun.contract import protocol
from dualrun.config import build_config
from dualrun.plan.processes import make_plan
from dualrun.rank.method import worker_settings
from helpers import REPO


def test_settings_written_by_the_plan_read_back_by_a_worker():
    cfg = build_config({"method": "gkd", "max_failures": 2, "collective_timeout_s": 30,
                        "roles": {"train": {"gpus": 0, "processes": 2},
                                  "teacher": {"gpus": 0, "model": "m", "top_k": 5}}}, "x.yaml")
    env = make_plan(cfg).env
    settings = protocol.Settings.from_env(env)
    assert settings.max_failures == 2 and settings.collective_timeout_s == 30
    assert settings.roles["train"].processes == 2 and settings.roles["teacher"].top_k == 5
    assert settings.to_env() == {protocol.SETTINGS: env[protocol.SETTINGS]}
    assert worker_settings(env) == json.loads(env[protocol.SETTINGS])


def test_partial_or_missing_settings_take_the_defaults():
    assert protocol.Settings.from_env({}) == protocol.Settings()
    partial = protocol.Settings.from_env({protocol.SETTINGS: '{"collective_timeout_s": 42, "later": 1}'})
    assert partial.collective_timeout_s == 42 and partial.roles == {} and not partial.offload_model


def test_address_names():
    assert protocol.address_env("rollout") == protocol.ROLLOUT_ADDRESS == "DUALRUN_ROLLOUT_ADDRESS"
    assert protocol.TEACHER_ADDRESS == "DUALRUN_TEACHER_ADDRESS"


def test_no_dualrun_env_name_spelled_outside_the_protocol_module():
    """A `"DUALRUN_..."` string literal anywhere but contract/protocol.py is a second copy of a protocol name. A
    backend folder may name its own, `DUALRUN_<BACKEND>_...`, in one module of its folder: the core never reads
    them (a plug-in backend cannot add to the core's protocol)."""
    found, owners = [], {}
    for path in sorted([*(REPO / "dualrun").rglob("*.py"), *(REPO / "plugins").rglob("*.py")]):
        if path == REPO / "dualrun" / "contract" / "protocol.py":
            continue
        rel = path.relative_to(REPO)
        own = f"DUALRUN_{rel.parts[2].upper()}_" if rel.parts[:2] == ("dualrun", "backends") and len(rel.parts) > 3 \
            else None
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and node.value.startswith("DUALRUN_") and node.value != "DUALRUN_*" \
                    and node.value != "DUALRUN_ROLE_PROGRAM":   # a module-level flag in a user's script
                if own and node.value.startswith(own):
                    owners.setdefault(own, set()).add(str(rel))
                    continue
                found.append(f"{rel}:{node.lineno}: {node.value}")
    assert not found, "\n".join(found)
    assert all(len(modules) == 1 for modules in owners.values()), owners   # a backend's names: one module


def test_protocol_imports_only_the_standard_library():
    """Ray workers import it before torch (and without dualrun's other modules)."""
    code = ("import sys; import dualrun.contract.protocol; "
            "bad = [m for m in ('torch', 'ray', 'yaml', 'transformers') if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_actor_replies_cross_a_process_boundary_intact():
    """What the Ray actors answer are small frozen dataclasses: pickled (as Ray does) they come back equal."""
    import pickle

    from dualrun.contract.protocol import ActorPlace, RankExit, ServerStart, WorkerStats

    replies = [ActorPlace("10.0.0.2", "n1", ("0", "1"), 42, 29500, 29501, tmp="/tmp/x"),
               RankExit(7, 1.5, "ValueError: bad", b"\x80"), ServerStart(False, error="x", port_in_use=True),
               WorkerStats(3, None)]
    assert [pickle.loads(pickle.dumps(r)) for r in replies] == replies
    assert replies[0].address == "10.0.0.2:29500"
