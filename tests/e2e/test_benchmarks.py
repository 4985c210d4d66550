"""The benchmark scripts must not rot: the table/chart/planner writer on fake numbers (fast, no processes), and
one real repetition of the two torchrun variants (e2e: needs the loopback-only namespace)."""
from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from helpers import REPO

BENCH = REPO / "benchmarks" / "launch_bench.py"


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_fake_numbers_write_table_chart_and_planner(tmp_path):
    """`--quick` (the smoke run benchmarks/README.md gives) on fake numbers: 2 repetitions of 60 steps."""
    r = _run("--fake", "--quick", "--out-dir", str(tmp_path), timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    md = (tmp_path / "launch.md").read_text()
    assert "60 steps" in md and "2 repetitions" in md, md
    every = md.split("## Every run", 1)[1]
    assert [ln.split("|")[1].strip() for ln in every.splitlines() if ln.startswith("| ") and "yes" in ln] == \
        ["1"] * 5 + ["2"] * 5, every
    for label in ("bare torchrun", "dualrun --backend torchrun", "Ray Train TorchTrainer",
                  "dualrun --backend ray (running cluster)", "dualrun --backend ray (embedded, cold)"):
        assert label in md
    assert "| 1.00x |" in md and "## Targets" in md and "load average" in md
    assert md.count("PASS") + md.count("FAIL") == 8
    planner = (tmp_path / "planner.md").read_text()
    assert "1,024 GPUs" in planner and "| 1024 |" in planner
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pytest.skip("matplotlib is not installed: no chart")
    assert (tmp_path / "launch.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("script", ["launch_bench", "growth_bench", "steady_ab", "profile_driver", "ray_idle_cost",
                                    "replica_throughput", "weight_sync_bench", "router_vs_vllm",
                                    "replica_restart_bench", "startup_bench", "quiet_readers_bench", "fleet_growth",
                                    "launch_cpu"])
def test_the_scripts_built_on_benchlib_start(script):
    """Each script that uses benchmarks/benchlib/ finds it and the names it imports (`--help` starts nothing)."""
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / f"{script}.py"), "--help"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "usage:" in r.stdout, r.stderr[-2000:]


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
def test_router_vs_vllm_router_benchmark_runs(tmp_path):
    """Both routers in front of the stub replicas, two loads, one repetition: every cell of the table filled."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from benchlib.servers import vllm_router_bin
    finally:
        sys.path.pop(0)
    if vllm_router_bin() is None:
        pytest.skip("vllm-router is not installed (pip install vllm-router; not a test dependency)")
    out = tmp_path / "r.md"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "router_vs_vllm.py"), "--no-engines", "--reps", "1",
                        "--inflight", "1", "8", "--requests", "40", "--per-inflight", "2", "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    text = out.read_text()
    rows = [ln for ln in text.splitlines() if ln.startswith("| 1 |") or ln.startswith("| 8 |")]
    assert len(rows) == 6 and not any("| - |" in ln for ln in rows), text   # 2 loads x (2 kinds + the target)
    assert (tmp_path / "r.json").exists()


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
    # the probe ran inside the ranks of both: every phase has a time, in order, and the threads were seen
    phase_rows = md.split("## Wall time by phase", 1)[1].split("\n\n", 2)[1].splitlines()[2:]
    assert len(phase_rows) == 2, md
    for row in phase_rows:
        medians = [float(c.split()[0]) for c in row.split("|")[2:-1]]
        assert len(medians) == 6 and medians == sorted(medians), row
    assert md.count("torch 1, interop") >= 2, md


def _bench_module(name: str):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import importlib

        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def test_steady_state_skips_the_warm_up_and_takes_the_slowest_rank():
    ph = _bench_module("benchlib.phases")
    # rank 0: a slow first step, then 10 ms steps using 5 ms CPU each; rank 1: 20 ms steps
    fast = {"rank": "0", "train_begin": 99.0, "steps": [(100.0, 1.0)] + [(100.0 + 0.01 * i, 1.0 + 0.005 * i)
                                                                     for i in range(1, 40)]}
    slow = {"rank": "1", "train_begin": 99.0, "steps": [(100.0 + 0.02 * i, 2.0 + 0.005 * i) for i in range(40)]}
    one = ph.steady(fast)
    assert one["step_ms"] == pytest.approx(10.0) and one["cpu_ms"] == pytest.approx(5.0)
    assert one["first_ms"] == pytest.approx(1000.0)
    job = ph.run_steady([fast, slow])
    assert job["steps_per_s"] == pytest.approx(50.0) and job["step_ms"] == pytest.approx(20.0)
    assert ph.steady({"steps": [(1.0, 1.0)] * 3}) is None          # too few steps: no steady state
    got = ph.phases([dict(fast, started=90.5, torch=92.0, rendezvous=95.0),
                     dict(slow, started=91.0, torch=93.0, rendezvous=96.0)], spawned=90.0, exited=101.0)
    assert got == pytest.approx({"workers_started": 1.0, "torch_imported": 3.0, "rendezvous": 6.0,
                                 "first_step": 10.0, "last_step": 100.0 + 0.02 * 39 - 90.0, "exit": 11.0})
    assert ph.phases([fast, {"rank": "1"}], 90.0, None)["first_step"] is None   # a rank without steps


def test_env_diff_ignores_per_run_variables():
    ab = _bench_module("steady_ab")
    bare = {"PATH": "/bin", "RANK": "0", "MASTER_PORT": "1", "X": "1"}
    dual = {"PATH": "/bin", "RANK": "1", "MASTER_PORT": "2", "ACCELERATE_MIXED_PRECISION": "no"}
    assert ab.env_diff(bare, dual) == {"X": None, "ACCELERATE_MIXED_PRECISION": "no"}


def test_growth_fit_and_report():
    gb = _bench_module("growth_bench")
    assert gb.fit([2, 8, 32], [1.0 + 0.5 * x for x in (2, 8, 32)]) == pytest.approx((1.0, 0.5))
    rows = [{"backend": "ray", "n": n, "rep": 0, "ok": True, "wall_s": 2.0 + n / 10, "cpu_s": 1.0 + n / 100,
             "rss_mib": 100 + n, "load": 1.0, "startup_s": 1.5 + n / 20} for n in (2, 8)]
    md = gb.report(rows, {"load_before": "1", "load_after": "1", "cluster_cpus": 4}, "planner")
    assert "| ray | 8 | 1 |" in md and "at 1,024 ranks" in md
    assert "| ray | driver CPU s | 1.00 | 10.0 ms | 11.2 |" in md


def test_growth_phases_per_rank_cost():
    """Each phase's own duration fitted against the rank count: the per-rank cost by phase."""
    gb = _bench_module("growth_bench")
    rows = [{"backend": "ray", "n": n, "rep": 0, "ok": True, "wall_s": 9.0, "cpu_s": 1.0, "rss_mib": 100, "load": 1.0,
             "connected": 1.0, "placed": 1.5, "actors": 1.5 + 0.1 * n, "programs": 1.6 + 0.1 * n,
             "script": 1.7 + 0.1 * n, "torch": None, "joined": None, "startup_s": 1.8 + 0.1 * n} for n in (8, 32)]
    assert gb.phase_steps(rows[0]) == pytest.approx({"connected": 1.0, "placed": 0.5, "actors": 0.8, "programs": 0.1,
                                                     "script": 0.1, "startup_s": 0.1})
    md = "\n".join(gb.phases_md(rows))
    assert "| ray | actors | 0.00 | 100.0 ms |" in md and "| ray | placed | 0.50 | 0.0 ms |" in md
    assert "| ray | 32 | 1.00 | 1.50 | 4.70 |" in md


def test_startup_report_on_fake_numbers(tmp_path):
    """`startup_bench.py --fake`: milestones, where each second goes, the targets; nothing started."""
    out = tmp_path / "startup.md"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "startup_bench.py"), "--fake", "--reps", "3",
                        "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    md = out.read_text()
    assert "FAKE" in md and md.count("PASS") + md.count("FAIL") == 3 and "## Where each second goes" in md
    assert "| `ray.init` returned: the embedded cluster is up | - | - | 2.4" in md
    sb = _bench_module("startup_bench")
    marks = {"dualrun_imported": 0.1, "cluster_up": 2.0, "ranks_up": 3.0, "exit": 9.0}
    assert sb.segments(marks) == pytest.approx({"dualrun_imported": 0.1, "cluster_up": 1.9, "ranks_up": 1.0,
                                                "exit": 6.0})
    pg = {"rank": [{"script": 101.0, "torch": 102.0, "joined": 103.0, "ran": 103.5},
                   {"script": 101.2, "torch": 102.5, "joined": 103.1, "ran": 103.4}],
          "driver": [{"cli_imported": 100.1, "agent_start": 100.9}], "actor": [], "floor": []}
    assert sb.milestones(100.0, 5.0, pg) == pytest.approx({
        "dualrun_imported": 0.1, "programs_started": 0.9, "ranks_up": 1.2, "torch_imported": 2.5, "rendezvous": 3.1,
        "first_step": 3.5, "exit": 5.0})


def test_machinery_cores_is_the_cpu_of_everything_but_the_ranks():
    ph = _bench_module("benchlib.phases")
    # two ranks, each burning one core from t=0 to t=10; everything together burned 2.5 cores: 0.5 is machinery
    ranks = [{"steps": [(0.1 * i, 0.1 * i) for i in range(101)]} for _ in range(2)]
    tree = [(0.0, 0.0), (5.0, 12.5), (10.0, 25.0)]
    assert ph.machinery_cores(ranks, tree) == pytest.approx(0.5)
    assert ph.machinery_cores(ranks, []) is None


def test_split_cores_per_kind_of_process():
    ph = _bench_module("benchlib.phases")
    ranks = [{"steps": [(0.1 * i, 0.1 * i) for i in range(101)]}]
    split = [(0.0, {"ray daemons": 0.0, "ranks": 0.0}), (10.0, {"ray daemons": 0.5, "ranks": 10.0})]
    assert ph.split_cores(ranks, split) == pytest.approx({"ray daemons": 0.05, "ranks": 1.0})


def test_the_machinery_is_summed_from_its_own_processes_where_the_ranks_are_processes_of_their_own():
    ph = _bench_module("benchlib.phases")
    split = {"launcher": 0.006, "ray actors": 0.02, "ray daemons": 0.01, "ranks": 1.4}
    assert ph.machinery_from_split(split) == pytest.approx(0.036)
    assert ph.machinery_from_split({"ray actors": 1.5, "launcher": 0.01}) is None   # Ray Train: ranks in the actors
    assert ph.machinery_from_split(None) is None


def test_a_launchers_command_line_is_the_launcher_though_it_names_the_script(tmp_path):
    """The launcher's own command line names the training script; it is not one of the ranks."""
    import subprocess
    import sys

    measure = _bench_module("benchlib.measure")
    script = str(measure.SCRIPT)
    wait = "import time; time.sleep(30)"
    launch = subprocess.Popen([sys.executable, "-c", wait, "-m", "dualrun", "launch", "--backend", "ray", script])
    rank = subprocess.Popen([sys.executable, "-c", wait, "-m", "dualrun.rank.bootstrap", script])
    try:
        time.sleep(0.3)
        assert measure.process_kind(launch.pid) == "launcher"
        assert measure.process_kind(rank.pid) == "ranks"
    finally:
        for p in (launch, rank):
            p.kill()
            p.wait()


def test_weight_sync_report_on_fake_numbers(tmp_path):
    """`weight_sync_bench.py --fake`: the report's tables (the full sync on loopback, where its time goes, the wire
    alone on loopback and on shaped links, each row against its limit) and the chart from synthetic numbers."""
    out = tmp_path / "ws.md"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "weight_sync_bench.py"), "--fake", "--out", str(out),
                        "--chart", str(tmp_path / "ws.png")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    md = out.read_text()
    rows = [ln for ln in md.splitlines() if ln.startswith(("| tiny |", "| 100M |"))]
    assert len(rows) == 12, md                       # 2 models x 2 layouts, in the three tables
    cpu = "| 100M | 2 | 0.30 (0.30–0.30) | 1.00 (1.00–1.00) | 0.10 (0.10–0.10) | 0.01 (0.01–0.01) |"
    assert cpu in md, md
    assert sum(ln.endswith(("| PASS |", "| FAIL |", "| PASS (median) |")) for ln in rows) == 4 and "Load average" in md
    assert "| 100M | 101.00M | 404.0 (7) | 2 |" in md
    shaped = [ln for ln in md.splitlines() if ln.startswith(("| 1gbit |", "| 5gbit |")) and "| 411.4 |" in ln]
    assert len(shaped) == 6 and all(">= 0.8 of the link" in ln for ln in shaped if ln.startswith("| 1gbit | 1 |"))
    assert all("<= 1.5x of 1 receiver" in ln for ln in shaped if "| 4 |" in ln), shaped
    # 1 Gbit/s: 411.4 MB at 125 MB/s is 3.29 s; the fake stream (115 MB/s, 5 % more per receiver) reaches 0.87 of it
    assert "| 1gbit | 1 | 411.4 | 3.29 | 3.76 (3.75–3.77) | 0.87 (0.87–0.88) | 1.00x |" in md
    assert "| 5gbit | 4 | 2.50 (2.50–2.50) |" in md, md   # the members' CPU-seconds during the stream
    wire_loopback = [ln for ln in md.splitlines() if ln.startswith(("| 1 | 411.4 |", "| 2 | 411.4 |", "| 4 | 411.4 |"))]
    assert len(wire_loopback) == 3
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "ws.png").stat().st_size > 10_000


def test_weight_sync_shaped_rows_are_held_against_their_limits():
    report = _bench_module("benchlib.weight_sync_report")
    run = lambda s: {"stream": s, "broadcast": 3 * s, "pack_s": 0, "send_wait_s": 0, "recv_s": 0}  # noqa: E731
    rows = [{"link": "1gbit", "rate_bps": 1e9, "receivers": n, "bytes": 125_000_000, "runs": [run(t)]}
            for n, t in ((1, 1.2), (4, 1.9))]
    one, four = report.shaped_rows(rows)
    assert one["limit"] == pytest.approx(1.0) and one["fraction"] == [pytest.approx(1 / 1.2)]
    assert one["verdicts"] == ["PASS (>= 0.8 of the link)"]
    assert four["fan"] == pytest.approx(1.9 / 1.2) and four["verdicts"] == ["FAIL (<= 1.5x of 1 receiver)"]


def test_weight_sync_server_timings_are_grouped_per_update(tmp_path):
    ws = _bench_module("weight_sync_bench")
    mark = _bench_module("benchlib.weight_sync_timing").MARK
    log = tmp_path / "server.log"
    lines = ["INFO vllm started"]
    for i in (1, 2):
        lines += [f'{mark} {{"phase": "start", "s": 0.{i}}}', "INFO other",
                  f'{mark} {{"phase": "update", "s": {i}.0, "recv_s": 0.5, "load_s": 0.25, "wait_s": 0.1, "chunks": 1, '
                  '"bytes": 8}',
                  f'{mark} {{"phase": "finish", "s": 0.0{i}}}']
    log.write_text("\n".join(lines) + "\n")
    syncs = ws.server_timings(str(log))
    assert [s["start"] for s in syncs] == [0.1, 0.2] and [s["finish"] for s in syncs] == [0.01, 0.02]
    assert syncs[1]["update"] == 2.0 and syncs[1]["relay"] == 0.1 and syncs[0]["bytes"] == 8


def test_fleet_growth_report_on_fake_numbers(tmp_path):
    """`fleet_growth.py --fake`: the join against the restart, the training time each loses, the sync at 1, 2 and 4
    members with its ratio to 1 member per repetition; nothing started."""
    out = tmp_path / "fg.md"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "fleet_growth.py"), "--fake", "--reps", "3",
                        "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    md = out.read_text()
    assert "FAKE" in md and "3 repetitions" in md and "Load average at the start" in md
    # the fake join: 20 s x (1, 1.01, 1.02); the restart to serving 60 s alike: 3x in every repetition
    assert "the ask -> the new replica in rotation holding the trainer's weights" in md
    assert "| 20.20 (20.00–20.40) |" in md and "| 3.00x (3.00–3.00) |" in md, md
    # lost: the join 20 s less 12 steps of 1 s; the restart 62 s less one step
    assert "its time less the steps taken meanwhile at that pace | 8.08 (8.00–8.16) |" in md, md
    assert "less one step, plus the steps redone | 61.61 (61.00–62.22) |" in md, md
    assert "| 1 | 9 | 0.101 (0.100–0.102) | 1.00x | - | 3.0 (3.0–3.0) |" in md
    assert "| 2 | 9 | 0.151 (0.150–0.153) | 1.50x (1.50–1.50) | 0.505 (0.500–0.510) | 4.5 (4.5–4.5) |" in md
    assert "| 4 | 9 | 0.253 (0.250–0.255) | 2.50x (2.50–2.50) |" in md
    assert "Grow 2 -> 4 (2 new engines started at once): the ask -> the last new replica serving 31.31" in md
    assert md.count("\n| 0 | 1.0 | 20.0 (15.0) | 5.0 / 60.0 / 62.0 |") == 1, md
    fg = _bench_module("benchlib.fleet_growth_report")
    one = fg.fake_reps(1)[0]
    assert fg.ratios_to_one([one, dict(one, syncs={"1": [0.2], "2": [0.2]})], 2) == pytest.approx([1.5, 1.0])
    assert fg.training_lost(dict(one, step_before_s=None)) == (None, None)
    assert fg.spread([]) == "-" and fg.spread([None, 2.0, 1.0, 3.0], 1) == "2.0 (1.0–3.0)"
    failed = fg.report([one, {"load": 9.0, "failed": "the job ended (1) before 6 syncs with 2 members:"}],
                       {"command": "c", "when": "w", "model": "m"})
    assert "2 repetitions, 1 failed" in failed and "| 1 | 9.0 | failed: the job ended (1) before 6 syncs" in failed
    assert "| 20.00 (20.00–20.00) |" in failed   # the numbers are the repetition that ran


def test_quiet_readers_report_holds_each_mode_side_by_side():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import quiet_readers_bench as qb
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    results = {mode: {"generate_s": [2.0, 1.9, 2.1], "step_after_s": [step, step, step], "step_rested_s": [1.0] * 3,
                      "server_cpu_s": [cpu] * 3} for mode, step, cpu in (("spin", 2.0, 1.0), ("quiet", 1.0, 0.02))}
    md = qb.report(results, {"command": "c", "when": "w", "reps": 3, "load_end": "1", "versions": "v"})
    assert "| trainer step right after a request (s) | 2.000 (2.000-2.000) | 1.000 (1.000-1.000) |" in md, md
    assert "| server's CPU-seconds in the second after a request | 1.000 (1.000-1.000) | 0.020 (0.020-0.020) |" in md
    assert "0.50 of its time with vLLM's readers; generation: 1.00 of its time" in md


def test_side_by_side_report_on_fake_numbers(tmp_path):
    """`startup_side_by_side.py --fake`: S, E, F per method and backend, the target per row; nothing started."""
    out = tmp_path / "sbs.md"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "startup_side_by_side.py"), "--fake", "--reps", "2",
                        "--methods", "gkd,grpo", "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    md = out.read_text()
    assert "FAKE" in md and md.count("| PASS |") == 8   # 2 methods x 2 backends, 2 tables; F 22.5 <= 1.15 x 20.5 + 3
    # against the cores: (30 + 20 CPU-s) / 2 cores = 25 s, above max(S, E) = 20.5: the limit
    assert "| gkd | torchrun | 30.0 | 20.0 | 50.0 | 25.0 | 25.0 | 22.5 | 0.90 | PASS |" in md
    assert "| gkd | torchrun | 20.5 (20.0–21.0) | 15.5 (15.0–16.0) | 22.5 (22.0–23.0) | 36.0 | 26.6 | 1.10 | PASS |" in md


def _index_rows() -> list[list[str]]:
    """The cells of each row of benchmarks/README.md's index table (the first table under "## Index")."""
    text = (REPO / "benchmarks" / "README.md").read_text().split("## Index\n", 1)[1]
    table = text[text.index("| script |"):].split("\n\n", 1)[0].splitlines()
    return [[c.strip() for c in ln.strip().strip("|").split(" | ")] for ln in table[2:]]


def _names(cell: str) -> set[str]:
    """The file names a cell gives in backticks, `a.{md,json}` spelled out."""
    out: set[str] = set()
    for name in re.findall(r"`([^`]+)`", cell):
        stem, _, exts = name.partition("{")
        out |= {stem + e for e in exts.rstrip("}").split(",")} if exts else {name}
    return {n for n in out if re.fullmatch(r"[\w./-]+\.\w+", n) and not n.startswith(("-", "."))}


def test_every_benchmark_is_in_the_index_and_every_result_has_its_script():
    """benchmarks/README.md's index matches the folder: each script there is a row (helpers live in benchlib/), each
    row's script exists, and each file in results/ is named by a row; a row names no result that is not there."""
    rows = _index_rows()
    scripts = {n for r in rows for n in _names(r[0])}
    named = {n for r in rows for n in _names(r[2]) if not n.endswith(".py")}
    here = {p.name for p in (REPO / "benchmarks").glob("*.py")}
    assert here == {s for s in scripts if "/" not in s}, "benchmarks/*.py and the index's scripts differ"
    assert all((REPO / "benchmarks" / s).exists() for s in scripts), scripts
    results = {p.name for p in (REPO / "benchmarks" / "results").iterdir()}
    assert results - named == set(), f"results with no script in the index: {sorted(results - named)}"
    assert named - results == set(), f"the index names results that are not there: {sorted(named - results)}"


WORK_LOG = re.compile(r"\bissues? #?\d+|(?<![\w/&])#\d+\b|\bsession \d+(?![.\d]* s\b)|\d{4}-\d{2}-\d{2} session",
                      re.I)


def test_no_issue_or_work_log_numbers_in_benchmarks():
    """A result says what was measured, where and under what load; an issue number or a work session's says
    nothing to a reader of the repository."""
    found = [f"{p.relative_to(REPO)}: {m.group(0)!r}" for p in sorted((REPO / "benchmarks").rglob("*"))
             if p.is_file() and p.suffix in (".md", ".py", ".json", ".sh", ".txt")
             for m in WORK_LOG.finditer(p.read_text(errors="replace"))]
    assert found == [], found
    assert WORK_LOG.search("as in issue 26") and WORK_LOG.search("(#46)") and WORK_LOG.search("session 11")
    assert not WORK_LOG.search("5 repetitions, session 436.4 s")


def test_launch_cpu_names_each_process_and_tables_before_and_after(tmp_path):
    """benchmarks/launch_cpu.py: the kind of each process from its command line (the root is the driver; what no
    rule names is told by its parent), and the by-process table on made-up rows."""
    import os

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import launch_cpu
        from benchlib.proctree import TreeSampler
    finally:
        sys.path.pop(0)
    assert launch_cpu.kind({"pid": 1, "cmd": "python -m dualrun launch x"}, 1) == "dualrun launch driver"
    assert launch_cpu.kind({"pid": 2, "cmd": "ray::DashboardAgent"}, 1) == "ray dashboard agent"
    assert launch_cpu.kind({"pid": 3, "cmd": "python -m dualrun.rank.bootstrap grpo.py"}, 1).startswith("trainer")
    rows = [{"run": "gkd on ray", "code": c, "rep": 0, "F": f, "cpu": {"driver": d, "ranks": 10.0}}
            for c, f, d in (("before", 12.0, 1.5), ("after", 11.0, 1.0))]
    md = launch_cpu.report(rows, {"when": "now", "cpus": 2, "load": 1.0, "load_end": 2.0}, "cmd")
    assert "| driver | 1.50 | 1.00 |" in md and "| **all** | **11.5** | **11.0** |" in md, md
    child = subprocess.Popen([sys.executable, "-c", "import time\nt=time.process_time()\n"
                              "while time.process_time()-t<0.3: pass\ntime.sleep(0.5)"])
    sampler = TreeSampler(os.getpid(), period_s=0.05)
    child.wait()
    mine = [p for p in sampler.stop() if p["pid"] == child.pid]
    assert mine and mine[0]["cpu_s"] >= 0.2, mine   # a child's own CPU, read before it exited
