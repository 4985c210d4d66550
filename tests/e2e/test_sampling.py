"""The sampling method end to end on CPU with tiny models: `dualrun launch --backend ray` (groups as actors on
an embedded cluster) and `--backend torchrun` (groups in-process) write the same JSONL for the same seed."""
from __future__ import annotations

import json
import tempfile

import pytest

from helpers import REPO, dualrun

ARGS = ["--num_completions", "2", "--limit", "4", "--max_new_tokens", "8", "--seed", "7", "--orm", "contains_answer"]


def test_reward_helpers():
    from dualrun.plugins.sampling import contains_answer, reward_function, split_steps

    assert split_steps("a is 1 . b is 2 .") == ["a is 1 .", "b is 2 ."]
    assert contains_answer("q", "it is 4 .", answer="4") == 1.0 and contains_answer("q", "14", answer=4) == 0.0
    assert reward_function("dualrun.plugins.sampling:length_penalty")("q", "a b") == -2.0
    assert reward_function("/some/model/path") is None


@pytest.mark.parametrize("backend", ["torchrun", "ray"])
def test_plan_shows_what_runs_the_driver_and_its_groups(backend):
    """Not a rank table: no `server` (a role program starts none) and each group once, with its devices."""
    res = dualrun("plan", "--config_file", str(REPO / "configs" / "sampling_swift.yaml"), "--backend", backend)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert "server" not in res.stdout and " rank " not in res.stdout, res.stdout
    assert lines[0].startswith(f"role program: runs once, as the {'Ray ' if backend == 'ray' else ''}driver"), lines
    assert [ln.split()[:2] for ln in lines[1:]] == [["sampler", "2"], ["prm", "2"], ["orm", "2"]], lines
    if backend == "torchrun":   # device_groups ranks 0,1 and 2,3: the plan's GPUs of this machine per group
        assert "sampler    2 worker(s), GPU 0,1" in lines[1] and "prm        2 worker(s), GPU 2,3" in lines[2]
    js = json.loads(dualrun("plan", "--json", "--config_file", str(REPO / "configs" / "sampling_cpu.yaml"),
                            "--backend", backend).stdout)
    assert js["role_program"]["groups_mode"] == ("ray" if backend == "ray" else "local")
    assert [(g["name"], g["size"]) for g in js["role_program"]["groups"]] == [("sampler", 2), ("prm", 1), ("orm", 1)]


def test_a_role_program_under_torchrun_runs_once_not_once_per_rank(tmp_path):
    """The dry run of the launch: one driver command (no torchrun), local groups, each started once."""
    res = dualrun("launch", "--backend", "torchrun", "--config_file", str(REPO / "configs" / "sampling_cpu.yaml"),
                  "--dry_run", str(REPO / "examples" / "sampling.py"), "--prompts", "p.jsonl", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "torch.distributed.run" not in res.stdout and "--nproc" not in res.stdout, res.stdout
    assert "role program run once as the driver (local groups)" in res.stdout
    (command,) = [ln for ln in res.stdout.splitlines() if ln.startswith("DUALRUN_ROLES_MODE=local ")]
    assert "dualrun.rank.bootstrap" in command and command.endswith("sampling.py --prompts p.jsonl")
    (tmp_path / "two.yaml").write_text("method: sampling\nuse_cpu: true\nnum_machines: 2\nmain_process_ip: 10.0.0.1\n"
                                       "roles: {sampler: {processes: 2}}\n")
    bad = dualrun("plan", "--config_file", "two.yaml", cwd=tmp_path)
    assert bad.returncode == 2 and "num_machines: expected 1 for a role program under torchrun" in bad.stderr


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(420)   # both backends: one driver, its 2 sampler workers and the prm/orm workers
def test_sampling_same_jsonl_on_both_backends(tiny, tmp_path):
    data = ["--model", str(tiny / "model"), "--prm", str(tiny / "teacher"), "--prompts",
            str(tiny / "data" / "prompts.jsonl")]
    outs = {}
    for backend in ("ray", "torchrun"):
        out = tmp_path / f"{backend}.jsonl"
        # an embedded cluster: after test_roles.py's in-process `ray.init(address="local")` in the same worker, the
        # run's shared cluster (conftest.ray_cluster) loses its actors (seen in CI, cause not found yet)
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
