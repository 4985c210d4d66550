"""Each method's unchanged example on 2 CPU processes under both backends: it finishes and the logged
metrics are equal for the same seed. Tolerance: exact equality (the runs are bit-identical on CPU/gloo)."""
from __future__ import annotations

import json
import re

import pytest

from helpers import REPO, dualrun, engine_pid, eventually, gone, link_tiny, pids_matching
from ray_helpers import ray_env

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

EXAMPLES = REPO / "examples"
METRICS = ("loss", "grad_norm", "reward", "entropy")
METHODS = {
    "pt": ("pt.py", ["--dataset_path", "tiny/data/pt.jsonl"]),
    "grpo": ("grpo.py", ["--dataset_path", "tiny/data/prompts.jsonl"]),
    "gkd": ("gkd.py", ["--dataset_path", "tiny/data/gkd.jsonl", "--teacher_model_name_or_path", "tiny/teacher"]),
    # the teacher as a separate role (its own process / actor), top-k distillation served over HTTP
    "gkd_separate_teacher": ("gkd.py", ["--dataset_path", "tiny/data/gkd.jsonl"]),
}
CONFIGS = {"gkd_separate_teacher": (REPO / "configs" / "gkd_cpu_separate_teacher.yaml").read_text()}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny):
    root = tmp_path_factory.mktemp("methods")
    link_tiny(tiny, root)
    for method in METHODS:
        text = CONFIGS.get(method, f"use_cpu: true\nmethod: {method}\nroles: {{train: {{gpus: 2}}}}\n")
        (root / f"{method}.yaml").write_text(text)
    return root


def _history(path):
    history = json.loads(path.read_text())["log_history"]
    return [{k: h[k] for k in METRICS if k in h} for h in history if "loss" in h]


def _assert_served_by_the_teacher_role(stderr: str) -> None:
    """GKDTrainer got the teacher role's server (its one line on rank 0); the server's own output reached the
    launch's stderr (on Ray too, from its actor), and the server is gone after the job."""
    assert re.search(r"GKD teacher served by the teacher role at 127\.0\.0\.1:\d+ \(top-5 ", stderr), stderr[-3000:]
    pid = engine_pid(stderr, "teacher server 0")
    assert "[teacher server 0] dualrun engine: serving" in stderr
    assert eventually(lambda: gone(pid)), "the teacher server must be stopped after the job"


@pytest.mark.parametrize("method", list(METHODS))
def test_method_runs_and_matches_across_backends(workdir, method, ray_cluster):
    script, extra = METHODS[method]
    args = [str(EXAMPLES / script), "--model_name_or_path", "tiny/model", *extra, "--seed", "3",
            "--save_strategy", "no", "--max_steps", "4"]
    env = ray_env(RAY_ADDRESS=ray_cluster.address)   # a running cluster (conftest): no embedded start per job
    history = {}
    for backend in ("torchrun", "ray"):
        out = f"out_{method}_{backend}"
        proc = dualrun("launch", "--backend", backend, "--config_file", f"{method}.yaml", *args, "--output_dir", out,
                       cwd=workdir, env=env, timeout=400)
        assert proc.returncode == 0, proc.stderr[-3000:]
        history[backend] = _history(workdir / out / "trainer_state.json")
        if method == "gkd_separate_teacher":
            _assert_served_by_the_teacher_role(proc.stderr)
    assert len(history["torchrun"]) == 4
    assert history["ray"] == history["torchrun"]
    ray_cluster.assert_nothing_left()
    assert not pids_matching(f"out_{method}_ray", "dualrun.rank.bootstrap")   # no rank process of the Ray job
