"""Cost as the job grows: driver CPU, driver memory and start-up time against the number of ranks.

    python benchmarks/growth_bench.py                      # --ranks 2,8,32,64 --reps 2; --quick: 2,8 x 1
    python benchmarks/growth_bench.py --backends ray,ray-train --script pg --ranks 8,32,64 --reps 1 \
        --out-name growth_raytrain                         # dualrun's Ray backend against Ray Train's TorchTrainer

One machine, an empty script (benchmarks/benchlib/empty_rank.py: says when it ran, imports nothing), through
`dualrun launch --backend ray` against a running local Ray cluster (head node of `ray.cluster_utils.Cluster`
with fake resources: --cluster-cpus CPUs, `ray.num_cpus_per_worker` 0.001 per rank actor, so 64 ranks fit on
2 real cores) and `dualrun launch --backend torchrun` (N local processes), interleaved per repetition. Per run,
measured from outside (benchlib.measure: the launcher's own pid sampled every 50 ms):

  start-up   spawn of `dualrun launch` until the last rank's script ran (its own time.time())
  wall       spawn until the launcher exited
  driver CPU user+system seconds of the launcher process alone (not its workers, not Ray's daemons)
  driver RSS peak resident memory (VmHWM) of the launcher process

`--script pg` runs benchmarks/benchlib/pg_rank.py instead: import torch, join the gloo group, one all_reduce (the first
step); start-up then ends when the last rank's all_reduce returned. It is the tiniest job Ray Train can run
(`ray-train`: benchmarks/benchlib/ray_train_driver.py, a `TorchTrainer` whose loop runs the script; TorchTrainer sets up
torch's process group itself), so the comparison with Ray Train uses it on both sides. Per run it also records
where the start-up went (the probe, benchmarks/probe/: the driver's steps, every rank actor's process start and
construction, the ranks' own times) and fits each phase against the rank count: the per-rank cost by phase.
Before a run of 32 or more ranks it checks the memory available (`--min-free-gib`) and skips the run if short.

Also times the planner (`make_plan` + `to_json`) for 128 nodes x 8 GPUs. Writes results/growth.md (table, fit,
extrapolation to 1,024 ranks, load average per run) and results/growth.png (matplotlib).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import REPO, RESULTS, noise
from benchlib import phases as ph
from benchlib.cluster import RunningCluster
from benchlib.measure import Run, measure
from benchlib.planner import bench_planner
from benchlib.report import fmt
from benchlib.sandbox import ensure_loopback_only

HERE = Path(__file__).resolve().parent

EMPTY = HERE / "benchlib" / "empty_rank.py"
LABELS = {"ray": "dualrun --backend ray", "torchrun": "dualrun --backend torchrun",
          "ray-train": "Ray Train TorchTrainer"}
# memory a rank takes (GiB, measured here: the drop of MemAvailable during the 32-rank runs), for the check before
# a run of 32 or more ranks; anything else: 0.05
RANK_GIB = {("ray-train", "pg"): 0.3, ("ray", "pg"): 0.13, ("torchrun", "pg"): 0.13}
SCRIPTS = {"empty": EMPTY, "pg": HERE / "benchlib" / "pg_rank.py"}
BACKENDS = ("ray", "torchrun", "ray-train")
# phase -> what the time means (seconds after the launcher's spawn; the last rank or actor counts)
PHASES = (("connected", "the driver joined the cluster (dualrun: `ray.init` returned)"),
          ("placed", "dualrun: the placement group placed"),
          ("actors", "dualrun: every rank actor built (`RankWorker.__init__` ran in its Ray worker)"),
          ("programs", "dualrun: every rank's program spawned (Ray) / torchrun's agent called"),
          ("script", "every rank's script started"),
          ("torch", "`import torch` done in every rank (pg script)"),
          ("joined", "every rank in the process group (pg script; Ray Train: before its loop)"),
          ("startup_s", "the last rank ran (empty script) / its all_reduce returned (pg script)"))
METRICS = (("startup_s", "start-up s"), ("wall_s", "wall s"), ("cpu_s", "driver CPU s"), ("rss_mib", "driver RSS MiB"))


def config(folder: Path, n: int) -> Path:
    path = folder / f"growth-{n}.yaml"
    path.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nmixed_precision: 'no'\n"
                    f"use_cpu: true\nnum_machines: 1\nmethod: sft\nroles:\n  train: {{gpus: {n}}}\n"
                    "ray: {num_cpus_per_worker: 0.001}\n")
    return path


def one(backend: str, n: int, rep: int, env: dict[str, str], work: Path, timeout: float, script: Path,
        actors_dir: Path | None = None) -> dict:
    folder = work / f"ranks-{backend}-{n}-{rep}"
    folder.mkdir(parents=True)
    if backend == "ray-train":
        cmd = [sys.executable, str(HERE / "benchlib" / "ray_train_driver.py"), "--num-workers", str(n), "--cpus-per-worker",
               "0.001", "--storage", str(work / f"raytrain-{n}-{rep}"), str(script)]
    else:
        cmd = [sys.executable, "-m", "dualrun", "launch", "--backend", backend, "--config_file",
               str(config(work, n)), "--num_processes", str(n), str(script)]
    run = Run(f"{backend}-{n}", rep)
    env = ph.probe_env(env, folder)
    for old in (actors_dir.glob("actor-*.json") if actors_dir else ()):
        old.unlink()
    measure(run, cmd, env, REPO, work / f"{backend}-{n}-{rep}.log", timeout)
    ranks = lb_ranks(folder)
    row = {"backend": backend, "n": n, "rep": rep, "ok": run.exit_code == 0 and len(ranks) == n,
           "wall_s": run.wall_s, "cpu_s": run.driver_cpu_s, "rss_mib": run.driver_rss_mib, "load": run.load_1m,
           "startup_s": max(r["ran"] for r in ranks) - run.spawned if len(ranks) == n else None}
    row.update(phase_marks(run.spawned, ranks if len(ranks) == n else [], lb_ranks(folder, "driver-*.json"),
                           lb_ranks(actors_dir, "actor-*.json") if actors_dir else []))
    if not row["ok"]:
        log = (work / f"{backend}-{n}-{rep}.log").read_text()[-600:].replace("\n", " | ")
        row["error"] = f"exit {run.exit_code}, {len(ranks)}/{n} ranks ran: {log}"
    shutil.rmtree(folder, ignore_errors=True)
    return row


def phase_marks(spawned: float, ranks: list[dict], drivers: list[dict], actors: list[dict]) -> dict:
    """Seconds after `spawned` at which the run reached each of PHASES (None where it does not go through it)."""
    drv = drivers[0] if drivers else {}
    made = [a["actor_made"] for a in actors if a.get("actor_made")]

    def last(key: str) -> float | None:
        return max(r[key] for r in ranks) - spawned if ranks and all(r.get(key) for r in ranks) else None

    def at(key: str) -> float | None:
        return drv[key] - spawned if drv.get(key) else None

    return {"connected": at("ray_connect_end"), "placed": at("place_end"),
            "actors": max(made) - spawned if made else None, "programs": at("start_end") or at("agent_start"),
            "script": last("script") or last("ran"), "torch": last("torch"), "joined": last("joined")}


def lb_ranks(folder: Path, pattern: str = "rank-*.json") -> list[dict]:
    import json

    out = []
    for p in folder.glob(pattern):
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            pass
    return out


def fit(xs: list[float], ys: list[float]) -> tuple[float, float] | None:
    """Least-squares line y = a + b x (the per-rank cost is b)."""
    if len(set(xs)) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def summarize(rows: list[dict]) -> dict:
    out: dict = {}
    for r in rows:
        if r["ok"]:
            out.setdefault(r["backend"], {}).setdefault(r["n"], []).append(r)
    return out


def report(rows: list[dict], info: dict, planner: str) -> str:
    s = summarize(rows)
    md = ["| backend | ranks | n | " + " | ".join(label for _, label in METRICS) + " |",
          "|---|---:|---:|" + "---:|" * len(METRICS)]
    fits = []
    for backend, by_n in s.items():
        for n in sorted(by_n):
            cells = []
            for m, _ in METRICS:
                vals = [r[m] for r in by_n[n] if r[m] is not None]
                d = 0 if m == "rss_mib" else 2
                cells.append(f"{statistics.median(vals):.{d}f} ({min(vals):.{d}f}–{max(vals):.{d}f})" if vals else "-")
            md.append(f"| {backend} | {n} | {len(by_n[n])} | " + " | ".join(cells) + " |")
        for m, label in METRICS:
            pts = [(n, statistics.median(r[m] for r in by_n[n] if r[m] is not None)) for n in by_n
                   if any(r[m] is not None for r in by_n[n])]
            f = fit([p[0] for p in pts], [p[1] for p in pts])
            if f:
                a, b = f
                fits.append(f"| {backend} | {label} | {a:.2f} | {b * 1000 if m != 'rss_mib' else b:.{1 if m != 'rss_mib' else 2}f}"
                            f"{' ms' if m != 'rss_mib' else ' MiB'} | {a + b * 1024:.1f} |")
    md += ["", "Each cell: median (min–max) over the repetitions.", "",
           "Linear fit over the measured points (y = a + b × ranks) and what it gives at 1,024 ranks:", "",
           "| backend | metric | a (fixed) | b (per rank) | at 1,024 ranks |", "|---|---|---:|---:|---:|", *fits,
           "", "Every run:", "", "| backend | ranks | rep | ok | start-up s | wall s | driver CPU s | RSS MiB | load 1m |",
           "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        md.append(f"| {r['backend']} | {r['n']} | {r['rep'] + 1} | {'yes' if r['ok'] else 'no: ' + r['error'][:300]} | "
                  f"{fmt(r['startup_s'])} | {fmt(r['wall_s'])} | {fmt(r['cpu_s'])} | {fmt(r['rss_mib'], 0)} | "
                  f"{fmt(r['load'])} |")
    md += phases_md(rows)
    md += ["", "## Planner: 128 nodes x 8 GPUs", "", planner, "",
           f"Machine: {info.get('cpus')} CPUs ({info.get('cpu', '?')}), {info.get('mem_total_gib')} GiB; load average "
           f"before {info['load_before']}, after {info['load_after']}; ray {info.get('ray')}, torch "
           f"{info.get('torch')}, git {info.get('git')}; running cluster: {info['cluster_cpus']} fake CPUs; "
           f"rank script: benchmarks/{info.get('script', 'empty_rank.py')}."]
    return "\n".join(md)


def phase_steps(row: dict) -> dict[str, float]:
    """Where one run's start-up went: each phase's time minus the previous one's it went through (PHASES order)."""
    out, last = {}, 0.0
    for name, _ in PHASES:
        if row.get(name) is not None:
            out[name] = row[name] - last
            last = row[name]
    return out


def phases_md(rows: list[dict]) -> list[str]:
    """The phases table (when, median over repetitions) and the per-rank cost of each phase (a linear fit of its
    duration against the rank count): where a launcher's start-up cost per rank goes."""
    s = summarize(rows)
    head = "| backend | ranks | " + " | ".join(name for name, _ in PHASES) + " |"
    md = ["", "## Where the start-up goes", "", "Seconds after the launcher's spawn at which the last rank (or "
          "actor) reached each phase, median over the repetitions (`-`: the launcher does not go through it):", "",
          *(f"- **{name}**: {what}" for name, what in PHASES), "", head, "|---|---:|" + "---:|" * len(PHASES)]
    fits = []
    for backend, by_n in s.items():
        for n in sorted(by_n):
            cells = []
            for name, _ in PHASES:
                vals = [r[name] for r in by_n[n] if r.get(name) is not None]
                cells.append(f"{statistics.median(vals):.2f}" if vals else "-")
            md.append(f"| {backend} | {n} | " + " | ".join(cells) + " |")
        for name, _ in PHASES:
            pts = []
            for n in sorted(by_n):
                vals = [phase_steps(r)[name] for r in by_n[n] if name in phase_steps(r)]
                if vals:
                    pts.append((n, statistics.median(vals)))
            f = fit([x for x, _ in pts], [y for _, y in pts])
            if f:
                a, b = (round(x, 6) + 0.0 for x in f)   # no "-0.00"
                fits.append(f"| {backend} | {name} | {a:.2f} | {b * 1000:.1f} ms |")
    md += ["", "Each phase's own duration (from the previous phase the run went through) fitted against the rank "
           "count, y = a + b × ranks: b is what one more rank costs in that phase.", "",
           "| backend | phase | a (fixed) s | b (per rank) |", "|---|---|---:|---:|", *fits]
    return md


def chart(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("growth_bench: matplotlib is not installed: no chart", file=sys.stderr)
        return False
    s = summarize(rows)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (m, label) in zip(axes, (METRICS[0], METRICS[2], METRICS[3])):
        for backend, by_n in s.items():
            ns = sorted(by_n)
            med = [statistics.median(r[m] for r in by_n[n] if r[m] is not None) for n in ns]
            lo = [mm - min(r[m] for r in by_n[n] if r[m] is not None) for n, mm in zip(ns, med)]
            hi = [max(r[m] for r in by_n[n] if r[m] is not None) - mm for n, mm in zip(ns, med)]
            ax.errorbar(ns, med, yerr=[lo, hi], marker="o", capsize=3, label=LABELS.get(backend, backend))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks (one machine, empty script)")
        ax.set_ylabel(label)
        ax.set_title(label)
        ax.legend(fontsize=8)
    fig.suptitle("launcher cost as the job grows (median, min–max)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="2,8,32,64")
    p.add_argument("--torchrun-ranks", default=None, help="rank counts for the torchrun backend (default: --ranks)")
    p.add_argument("--backends", default="ray,torchrun")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="ranks 2,8, one repetition")
    p.add_argument("--cluster-cpus", type=int, default=4)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--out-dir", default=str(RESULTS))
    p.add_argument("--out-name", default="growth", help="the report's name: OUT_DIR/NAME.md and NAME.png")
    p.add_argument("--script", choices=sorted(SCRIPTS), default="empty",
                   help="empty: a rank that only says when it ran; pg: torch, the gloo group, one all_reduce "
                   "(what ray-train needs)")
    p.add_argument("--min-free-gib", type=float, default=12.0,
                   help="before a run of 32 or more ranks: skip it unless this much memory is available")
    p.add_argument("--no-planner", dest="planner", action="store_false", help="skip the planner timing")
    p.add_argument("--add-to", default=None, metavar="JSON",
                   help="an earlier run's NAME.json: its runs come first in this report (one more rank count "
                   "measured later, e.g. when memory allows it)")
    ns = p.parse_args(argv)
    if ns.quick:
        ns.ranks, ns.reps = "2,8", 1
    ranks = [int(x) for x in ns.ranks.split(",")]
    t_ranks = [int(x) for x in (ns.torchrun_ranks or ns.ranks).split(",")]
    backends = [b for b in ns.backends.split(",") if b]
    if set(backends) - set(BACKENDS):
        p.error(f"unknown backend(s) {sorted(set(backends) - set(BACKENDS))}: choose from {', '.join(BACKENDS)}")
    if "ray-train" in backends and ns.script != "pg":
        p.error("ray-train runs only --script pg (TorchTrainer always sets up torch's process group)")
    script = SCRIPTS[ns.script]
    ensure_loopback_only(sys.argv[1:] if argv is None else argv)
    info = noise.machine()
    info.update(load_before=" / ".join(f"{x:.2f}" for x in os.getloadavg()), cluster_cpus=ns.cluster_cpus,
                script=script.name)
    work = Path(tempfile.mkdtemp(prefix="grw", dir="/tmp"))
    actors_dir = work / "actors"   # the running cluster's actors inherit this process's env: the probe records them
    actors_dir.mkdir()
    cluster = RunningCluster(ns.cluster_cpus)
    rows = []
    try:
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "DUALRUN_BENCH_UNSHARED")}
        env["PYTHONUNBUFFERED"] = "1"
        # accelerate's env is cached per config (dualrun/launchers/accelerate_env.py): a dry run fills the cache, so the
        # timed runs show the launcher's recurring cost, not the one-time torch import of a new config
        for n in sorted(set(ranks) | set(t_ranks)):
            subprocess.run([sys.executable, "-m", "dualrun", "launch", "--dry_run", "--config_file",
                            str(config(work, n)), "--num_processes", str(n), str(EMPTY)],
                           env=ph.probe_env(env, work), capture_output=True, timeout=ns.timeout)   # same key
        if {"ray", "ray-train"} & set(backends):
            saved = {k: os.environ.get(k) for k in ("PYTHONPATH", ph.DIR_ENV)}
            os.environ.update(ph.probe_env(dict(os.environ), actors_dir))
            try:
                cluster.start()
            finally:
                for k, v in saved.items():
                    os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
            time.sleep(3)
        for rep in range(ns.reps):
            for n in sorted(set(ranks) | set(t_ranks)):
                for backend in (backends if rep % 2 == 0 else backends[::-1]):
                    if n not in (t_ranks if backend == "torchrun" else ranks):
                        continue
                    free = noise.machine().get("mem_available_gib", 0.0)
                    need = max(ns.min_free_gib, 2.0 + n * RANK_GIB.get((backend, ns.script), 0.05))
                    if n >= 32 and free < need:
                        print(f"rep {rep + 1} {backend:9s} {n:4d} ranks: skipped, {free} GiB available, "
                              f"{need:.1f} needed", flush=True)
                        rows.append({"backend": backend, "n": n, "rep": rep, "ok": False, "startup_s": None,
                                     "wall_s": None, "cpu_s": None, "rss_mib": None, "load": os.getloadavg()[0],
                                     "error": f"skipped: {free} GiB of memory available, about "
                                     f"{need:.0f} GiB needed"})
                        continue
                    ray = backend in ("ray", "ray-train")
                    e = dict(env, RAY_ADDRESS=cluster.address) if ray else env
                    r = one(backend, n, rep, e, work, ns.timeout, script, actors_dir if ray else None)
                    rows.append(r)
                    print(f"rep {rep + 1} {backend:8s} {n:4d} ranks: start-up {fmt(r['startup_s'])} s wall "
                          f"{fmt(r['wall_s'])} s driver CPU {fmt(r['cpu_s'])} s RSS {fmt(r['rss_mib'], 0)} MiB "
                          f"load {r['load']:.2f} {'ok' if r['ok'] else r['error'][:300]}", flush=True)
    finally:
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
    info["load_after"] = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    out = Path(ns.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    info["command"] = f"`python benchmarks/growth_bench.py {' '.join(sys.argv[1:] if argv is None else argv)}`"
    if ns.add_to:
        earlier = json.loads(Path(ns.add_to).read_text())
        info["command"] = f"{earlier['info'].get('command', '?')}, then {info['command']}"
        rows = earlier["rows"] + rows
        info["load_before"] = f"{earlier['info']['load_before']} (earlier run), {info['load_before']} (this run)"
    (out / f"{ns.out_name}.json").write_text(json.dumps({"rows": rows, "info": info}, indent=1))
    planner = bench_planner(5) if ns.planner else "(not timed in this run: --no-planner)"
    has_chart = chart(rows, out / f"{ns.out_name}.png")
    text = report(rows, info, planner)
    (out / f"{ns.out_name}.md").write_text(
        f"# Launcher cost as the job grows\n\nCommand: {info['command']} — written "
        f"{time.strftime('%Y-%m-%d %H:%M')}\n\n"
        + text + (f"\n\n![growth]({ns.out_name}.png)\n" if has_chart else "\n"))
    print(text)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
