"""Launch overhead and throughput: dualrun against bare torchrun and Ray Train, same tiny SFT, same session.

    python benchmarks/launch_bench.py                   # 5 reps x 200 steps; --quick: 2 x 60 (matplotlib: chart)

Runs the unchanged `examples/sft.py` (tiny offline model, 2 processes, gloo on CPU, a fixed number of steps)
through five launchers, interleaved round-robin per repetition:

  torchrun              python -m torch.distributed.run --nproc-per-node 2 examples/sft.py ...  (no dualrun)
  dualrun-torchrun      dualrun launch --backend torchrun --config_file configs/sft_cpu.yaml examples/sft.py ...
  ray-train             Ray Train TorchTrainer whose train_loop_per_worker runs the script with runpy
                        (benchmarks/benchlib/ray_train_driver.py), against a running local cluster
  dualrun-ray           dualrun launch --backend ray ..., RAY_ADDRESS = the same running local cluster
  dualrun-ray-embedded  dualrun launch --backend ray ..., RAY_ADDRESS unset and no cluster running (cold start)

Per run it measures, from outside the launcher (one fresh process per run): wall time (spawn to exit), time to
the first `{'loss': ...}` line on the launcher's output, the trainer's own train_steps_per_second (worker-side:
max_steps / train_runtime), the loss-line rate as the driver sees it (after the first 10% of steps), and the
launcher process's own peak RSS (VmHWM of that one pid, sampled every 50 ms) and CPU seconds. Inside the ranks,
the probe (benchmarks/probe/, loaded through PYTHONPATH by every launcher) records the phases (worker started,
torch imported, rendezvous, first and last step) and every step's wall and CPU time: the steady-state steps/s
(after the first 10% of steps, slowest rank) that the throughput targets use. Writes
results/launch.md (table, targets, per-run rows, machine), results/launch.png and results/planner.md, and
refreshes the table in benchmarks/README.md when writing to the default results folder.

Network: every run must use loopback only. The script refuses to run in a namespace with any interface other
than `lo`; as root it re-executes itself under `unshare -n` and brings `lo` up, so the command above just works
there. The "running cluster" is started by this script (head node of `ray.cluster_utils.Cluster`, 4 CPUs, its own
short temp dir, no dashboard) while the cluster variants run, and shut down (its own processes only) before the
no-cluster variants; it never runs `ray stop`.

`--fake` writes the table, the chart and the planner results from synthetic numbers without starting anything
(used by tests/e2e/test_benchmarks.py).

This script is the session (the schedule, the run loop, the command line); the sandbox, the machine's noise, the
measuring, the running cluster, the report and the planner are benchmarks/benchlib/, which the other benchmarks
share.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import BENCH, REPO, RESULTS, noise
from benchlib import phases as ph
from benchlib.cluster import RunningCluster
from benchlib.job import VARIANTS, command, script_args
from benchlib.measure import Run, add_probe, measure
from benchlib.options import add_run_options, chosen_variants
from benchlib.planner import write_planner
from benchlib.report import fmt, write_launch
from benchlib.sandbox import ensure_loopback_only


# -- the session -------------------------------------------------------------------------------------------------

def schedule(variants: list[str], reps: int) -> list[list[str]]:
    """Round-robin: every repetition runs every variant once; the cluster group and the no-cluster group
    alternate in order, and each group's order rotates, so no variant always runs first or right after a start."""
    with_cluster = [v for v in variants if VARIANTS[v][1]]
    without = [v for v in variants if not VARIANTS[v][1]]
    out = []
    for r in range(reps):
        a = with_cluster[r % len(with_cluster):] + with_cluster[:r % len(with_cluster)] if with_cluster else []
        b = without[r % len(without):] + without[:r % len(without)] if without else []
        out.append(a + b if r % 2 == 0 else b + a)
    return out


def run_session(ns: argparse.Namespace) -> tuple[list[Run], dict]:
    """Every repetition of every variant, with the running cluster up for the variants that join it; the runs and
    the machine they ran on."""
    variants = ns.variants
    work = Path(tempfile.mkdtemp(prefix="lb", dir="/tmp"))
    logs = Path(ns.keep_logs) if ns.keep_logs else work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    info = noise.machine()
    info["load_before"] = noise.loadavg()
    info["steps"], info["reps"], info["nproc"] = ns.steps, ns.reps, ns.nproc
    tiny = work / "tiny"
    subprocess.run([sys.executable, str(REPO / "examples" / "make_tiny_model.py"), "--out", str(tiny)], check=True,
                   capture_output=True)
    base_env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "DUALRUN_BENCH_UNSHARED")}
    base_env.update(ACCELERATE_USE_CPU="true", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    cluster = RunningCluster(ns.cluster_cpus)
    runs: list[Run] = []
    t_start = time.monotonic()
    try:
        if ns.warmup:  # page cache: the first import of torch/transformers/trl from a cold disk is not a launcher cost
            print("warm-up: one untimed bare torchrun run", flush=True)
            measure(Run("warmup", -1), command("torchrun", script_args(tiny, work / "warmup", 2), ns.nproc),
                    base_env, REPO, logs / "warmup.log", ns.timeout)
        cluster_starts, cluster_idle = [], []
        for rep, order in enumerate(schedule(variants, ns.reps)):
            for variant in order:
                needs = VARIANTS[variant][1]
                if needs and cluster.cluster is None:
                    cluster_starts.append(cluster.start())
                    time.sleep(ns.settle)  # let the fresh cluster finish its own start-up work
                    cluster_idle.append(cluster.idle_cores())
                elif not needs and cluster.cluster is not None:
                    cluster.stop()
                env = dict(base_env)
                ray_tmp = None
                if variant in ("ray-train", "dualrun-ray"):
                    env["RAY_ADDRESS"] = cluster.address
                elif variant == "dualrun-ray-embedded":
                    ray_tmp = tempfile.mkdtemp(prefix="lbe", dir="/tmp")   # no `ray start` bookkeeping to find
                    env["RAY_TMPDIR"] = ray_tmp
                probe = work / "probe" / f"{variant}-{rep}"
                probe.mkdir(parents=True)
                env = ph.probe_env(env, probe)
                args = script_args(tiny, work / "out" / f"{variant}-{rep}", ns.steps)
                cmd = command(variant, args, ns.nproc)
                if variant == "ray-train":
                    cmd[2:2] = ["--storage", str(work / f"raytrain-{rep}")]
                busy = noise.wait_quiet(ns.quiet_cores, ns.quiet_wait)
                run = measure(Run(variant, rep, busy_before=busy), cmd, env, REPO, logs / f"{variant}-{rep}.log",
                              ns.timeout)
                add_probe(run, ph.load(probe), ns.nproc)
                if ray_tmp:
                    shutil.rmtree(ray_tmp, ignore_errors=True)
                shutil.rmtree(work / "out" / f"{variant}-{rep}", ignore_errors=True)
                runs.append(run)
                status = "ok" if run.ok else f"FAILED ({run.error})"
                print(f"rep {rep + 1}/{ns.reps} {variant:22s} wall {run.wall_s:6.1f} s  first step "
                      f"{fmt(run.first_step_s)} s  steps/s {fmt(run.steps_per_s)}  driver RSS "
                      f"{fmt(run.driver_rss_mib, 0)} MiB  load {run.load_1m:.2f}  busy before {busy:.2f} cores  "
                      f"{status}", flush=True)
        cluster.stop()
        info["cluster_start_s"] = [round(x, 1) for x in cluster_starts]
        info["cluster_idle_cores"] = [round(x, 3) for x in cluster_idle]
        busy = sorted(r.busy_before for r in runs if r.busy_before is not None)
        if busy:
            info["busy"] = f"median {statistics.median(busy):.2f}, min {busy[0]:.2f}, max {busy[-1]:.2f}"
    finally:
        cluster.stop()
        info["load_after"] = noise.loadavg()
        info["session_s"] = round(time.monotonic() - t_start, 1)
        shutil.rmtree(work, ignore_errors=True)   # logs survive only in --keep-logs DIR
    return runs, info



# -- fake numbers (tests) ----------------------------------------------------------------------------------------

def fake_runs(variants: list[str], reps: int) -> list[Run]:
    """Synthetic runs (seeded): the report's code paths without starting anything."""
    rnd = random.Random(0)
    base = {"torchrun": 17.0, "dualrun-torchrun": 17.3, "ray-train": 45.0, "dualrun-ray": 18.5,
            "dualrun-ray-embedded": 26.0}
    runs = []
    for r in range(reps):
        for v in variants:
            w = base[v] * rnd.uniform(0.97, 1.03)
            run = Run(v, r, True, 0, w, w - 4, 30 * rnd.uniform(0.95, 1.0), 29.0, 80, "3.5",
                      rnd.uniform(60, 400), rnd.uniform(2, 8), 1.0, 0.1)
            run.steady_steps_per_s, run.step_cpu_ms = 40 * rnd.uniform(0.97, 1.0), 18 * rnd.uniform(0.97, 1.03)
            run.machinery_cores = rnd.uniform(0.0, 0.1)
            run.own_cores = run.machinery_cores * 0.7 if v.startswith("dualrun") else None
            first = w - 6
            run.phases = {"workers_started": first * 0.15, "torch_imported": first * 0.35, "rendezvous": first * 0.8,
                          "first_step": first, "last_step": w - 1.5, "exit": w}
            runs.append(run)
    return runs


# -- main --------------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(p, variants=VARIANTS, steps=200, steps_help="training steps per run (max_steps)", quiet_cores=0.3,
                    quick_help="2 repetitions of 60 steps, planner 3 times (a smoke run: the full run is --reps 5 "
                    "--steps 200)", fake_help="synthetic launch numbers: write the outputs, start nothing")
    p.add_argument("--out-dir", default=str(RESULTS), help="where launch.md, launch.png, planner.md go")
    p.add_argument("--readme", default=None,
                   help="README whose table block to refresh (default: benchmarks/README.md with the default "
                   "--out-dir)")
    p.add_argument("--cluster-cpus", type=int, default=4, help="CPUs of the running cluster")
    p.add_argument("--settle", type=float, default=3.0, help="seconds to wait after starting the running cluster")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the untimed warm-up run")
    p.add_argument("--planner-reps", type=int, default=20)
    p.add_argument("--no-planner", dest="planner", action="store_false")
    ns = p.parse_args(argv)
    if ns.quick:
        ns.reps, ns.steps, ns.planner_reps = 2, 60, 3
    chosen = chosen_variants(p, ns.variants, VARIANTS)
    ns.variants = [v for v in VARIANTS if v in chosen]   # in the table's order
    out_dir = Path(ns.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    readme = Path(ns.readme) if ns.readme else (BENCH / "README.md" if out_dir == RESULTS.resolve() else None)
    command_line = "python benchmarks/launch_bench.py " + " ".join(argv)

    if ns.fake:
        info = noise.machine()
        info.update(load_before=noise.loadavg(), load_after=noise.loadavg(), steps=ns.steps, reps=ns.reps,
                    nproc=ns.nproc, busy="median 0.10 (fake)")
        runs = fake_runs(ns.variants, ns.reps)
    else:
        ensure_loopback_only(argv)
        runs, info = run_session(ns)
    main_readme = REPO / "README.md" if out_dir == RESULTS.resolve() and not ns.readme else None
    print(write_launch(runs, info, ns.variants, out_dir, command_line.strip(), readme, ns.fake, main_readme))
    if ns.planner:
        print("\n" + write_planner(out_dir, ns.planner_reps, info))
    print(f"\nwrote {out_dir / 'launch.md'}" + (f", {out_dir / 'planner.md'}" if ns.planner else ""))
    return 0 if all(r.ok for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
