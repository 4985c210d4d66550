"""The sampling method end to end on CPU with tiny models: `dualrun launch --backend ray` (groups as actors on
an embedded cluster) and `--backend torchrun` (groups in-process) write the same JSONL for the same seed."""
from __future__ import annotations

import json
import tempfile

import pytest

from conftest import REPO, dualrun

ARGS = ["--num_completions", "2", "--limit", "4", "--max_new_tokens", "8", "--seed", "7", "--orm", "contains_answer"]


def test_reward_helpers():
    from dualrun.plugins.sampling import contains_answer, reward_function, split_steps

    assert split_steps("a is 1 . b is 2 .") == ["a is 1 .", "b is 2 ."]
    assert contains_answer("q", "it is 4 .", answer="4") == 1.0 and contains_answer("q", "14", answer=4) == 0.0
    assert reward_function("dualrun.plugins.sampling:length_penalty")("q", "a b") == -2.0
    assert reward_function("/some/model/path") is None


def test_plan_shows_groups():
    res = dualrun("plan", "--config_file", str(REPO / "configs" / "sampling_swift.yaml"), "--backend", "torchrun")
    assert res.returncode == 0, res.stderr
    assert "role groups" in res.stdout and "prm        2 worker(s)" in res.stdout


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(420)   # torchrun: each of its 2 processes spawns the 2 sampler workers (as Ray starts actors)
def test_sampling_same_jsonl_on_both_backends(tiny, tmp_path):
    data = ["--model", str(tiny / "model"), "--prm", str(tiny / "teacher"), "--prompts",
            str(tiny / "data" / "prompts.jsonl")]
    outs = {}
    for backend in ("ray", "torchrun"):
        out = tmp_path / f"{backend}.jsonl"
        env = {"RAY_ADDRESS": "", "RAY_TMPDIR": tempfile.mkdtemp(prefix="drs", dir="/tmp"), "OMP_NUM_THREADS": "1"}
        res = dualrun("launch", "--backend", backend, "--config_file", str(REPO / "configs" / "sampling_cpu.yaml"),
                      str(REPO / "examples" / "sampling.py"), *data, *ARGS, "--out", str(out), cwd=tmp_path,
                      env=env, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        outs[backend] = [json.loads(line) for line in out.read_text().splitlines()]
    rows = outs["ray"]
    assert len(rows) == 4 * 2 and [(r["index"], r["sample"]) for r in rows] == [(i, j) for i in range(4)
                                                                              for j in range(2)]
    assert all(isinstance(r["orm_score"], float) and r["prm_scores"] and r["completion"] for r in rows)
    assert outs["ray"] == outs["torchrun"]
