"""The benchmark scripts must not rot: the table/chart/planner writer on fake numbers (fast, no processes), and
one real repetition of the two torchrun variants (e2e: needs the loopback-only namespace)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks" / "launch_bench.py"


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_fake_numbers_write_table_chart_and_planner(tmp_path):
    r = _run("--fake", "--reps", "3", "--planner-reps", "1", "--out-dir", str(tmp_path), timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    md = (tmp_path / "launch.md").read_text()
    for label in ("bare torchrun", "dualrun --backend torchrun", "Ray Train TorchTrainer",
                  "dualrun --backend ray (running cluster)", "dualrun --backend ray (embedded, cold)"):
        assert label in md
    assert "| 1.00x |" in md and "## Targets" in md and "load average" in md
    assert md.count("PASS") + md.count("FAIL") == 6
    planner = (tmp_path / "planner.md").read_text()
    assert "1,024 GPUs" in planner and "| 1024 |" in planner
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pytest.skip("matplotlib is not installed: no chart")
    assert (tmp_path / "launch.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_schedule_is_round_robin_and_rotates():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import launch_bench
    finally:
        sys.path.pop(0)
    names = list(launch_bench.VARIANTS)
    plan = launch_bench.schedule(names, 3)
    assert all(sorted(rep) == sorted(names) for rep in plan)
    assert len({rep[0] for rep in plan}) > 1          # no variant always first
    for rep in plan:  # the cluster variants run back to back (one cluster start per repetition at most)
        idx = [i for i, v in enumerate(rep) if launch_bench.VARIANTS[v][1]]
        assert idx == list(range(idx[0], idx[0] + len(idx)))


@pytest.mark.slow
def test_topk_memory_benchmark_runs_and_the_top_k_path_is_smaller(tmp_path):
    """Small vocabularies: both paths give the same loss; the top-k teacher holds B x T x k, the dense one
    B x T x V; the whole top-k step peaks below the dense one."""
    import json

    out, rows = tmp_path / "topk.md", tmp_path / "topk.json"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "topk_memory.py"), "--vocab", "4000", "16000",
                        "--seq", "64", "--k", "8", "--out", str(out), "--json", str(rows)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| 16,000 |" in out.read_text()
    for row in json.loads(rows.read_text()):
        assert row["loss_topk"] == pytest.approx(row["loss_dense"], abs=1e-5)
        assert row["held_topk"] == 64 * 8 * 12 and row["held_dense"] == 64 * row["vocab"] * 4
        assert row["step_topk"] < row["step_dense"]


@pytest.mark.e2e
def test_router_overhead_benchmark_runs(tmp_path):
    out = tmp_path / "router.md"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "router_overhead.py"), "--requests", "30",
                        "--warmup", "5", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    text = out.read_text()
    assert "| one prompt (to one replica) |" in text and "| two prompts (split over both) |" in text
    assert "after 60 more routed requests" in text


@pytest.mark.e2e
@pytest.mark.slow
def test_one_real_repetition_of_the_torchrun_variants(tmp_path):
    r = _run("--reps", "1", "--steps", "4", "--variants", "torchrun,dualrun-torchrun", "--no-warmup",
             "--no-planner", "--out-dir", str(tmp_path), timeout=280)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    md = (tmp_path / "launch.md").read_text()
    rows = [ln for ln in md.splitlines() if ln.startswith("| 1 | ")]
    assert len(rows) == 2 and all("| yes |" in ln for ln in rows), md
    # both launchers ran the same training: the same final loss
    assert len({ln.rsplit("|", 2)[1].strip() for ln in rows}) == 1, rows
