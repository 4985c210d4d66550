"""Start-up to the first step, phase by phase: dualrun against bare torchrun and against Ray's own floor.

    python benchmarks/startup_bench.py                 # 5 reps x 10 steps of the tiny SFT; --quick: 2 reps

Runs, interleaved round-robin per repetition, one fresh process each (benchlib.measure):

  torchrun              bare `python -m torch.distributed.run --nproc-per-node 2 examples/sft.py ...`
  dualrun-torchrun      `dualrun launch --backend torchrun --config_file configs/sft_cpu.yaml examples/sft.py ...`
  dualrun-ray-embedded  `dualrun launch --backend ray ...`, no cluster running: dualrun starts (and stops) its own
  ray-floor             benchmarks/benchlib/ray_floor.py: `import ray`, `ray.init()`, one actor answering, `ray.shutdown()`
  ray-floor-lean        the same on the lean node dualrun's embedded cluster is (no dashboard, monitors, metrics)

and says where each second goes: the probe (benchmarks/probe/sitecustomize.py) records, from outside dualrun's
code, when the driver finished its imports, checked the job, had accelerate's env, imported Ray, had its cluster,
placed the ranks, made the rank actors and started the programs (or torchrun's agent); inside the ranks, when
each interpreter was up, torch imported, the rendezvous done and the first step taken. All times are seconds
after the launcher's spawn (time.time(), one clock).

Targets: dualrun-torchrun's first step within 0.2 s of bare torchrun's; dualrun's embedded Ray start
within 1 s of Ray's own floor: the last rank's interpreter up (from there the job is the same as under torchrun)
at most 1 s after the floor's one actor answered. Writes results/startup.md. Loopback only (benchlib.sandbox).
`--fake` writes the report from synthetic numbers without starting anything (the test).
"""
from __future__ import annotations

import argparse
import json
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
from benchlib.job import SCRIPT, command, script_args
from benchlib.measure import Run, measure
from benchlib.options import add_run_options, chosen_variants
from benchlib.report import fmt, machine_md
from benchlib.sandbox import ensure_loopback_only

VARIANTS = {
    "torchrun": "bare torchrun",
    "dualrun-torchrun": "dualrun --backend torchrun",
    "dualrun-ray-embedded": "dualrun --backend ray (embedded)",
    "ray-floor": "Ray's floor: ray.init() + 1 actor",
    "ray-floor-lean": "Ray's floor, dualrun's lean node",
}
FLOORS = ("ray-floor", "ray-floor-lean")
# (milestone, what happened by then): the order a launch goes through; a variant has the ones it goes through
MILESTONES = (
    ("dualrun_imported", "interpreter up, dualrun's CLI imported"),
    ("job_checked", "config, plugin and environment checked"),
    ("accelerate_env", "accelerate's env (cached on disk after the first launch of a config)"),
    ("ray_imported", "`import ray` done"),
    ("cluster_up", "`ray.init` returned: the embedded cluster is up"),
    ("placed", "the placement group is placed"),
    ("actors_made", "every rank actor made (its Ray worker process started, RankWorker built)"),
    ("programs_started", "every rank's program spawned (Ray) / torchrun's agent called (torchrun)"),
    ("ranks_up", "every rank's interpreter up (the probe ran)"),
    ("torch_imported", "`import torch` done in every rank"),
    ("rendezvous", "`init_process_group` returned in every rank"),
    ("first_step", "the first optimizer step ended in every rank"),
    ("cluster_down", "`ray.shutdown()` returned"),
    ("exit", "the launcher exited"),
)


# -- one run's milestones (pure) ---------------------------------------------------------------------------------

def milestones(spawned: float, wall: float | None, records: dict[str, list[dict]]) -> dict[str, float]:
    """Seconds after `spawned` of every milestone the records show (`records`: kind -> the probe's files)."""
    out: dict[str, float] = {}
    drv = (records.get("driver") or [{}])[0]
    for key, name in (("cli_imported", "dualrun_imported"), ("run_job_start", "job_checked"),
                      ("accelerate_env_end", "accelerate_env"), ("ray_imported", "ray_imported"),
                      ("ray_connect_end", "cluster_up"), ("place_end", "placed"), ("start_end", "programs_started"),
                      ("agent_start", "programs_started"), ("ray_shutdown_end", "cluster_down")):
        if drv.get(key):
            out[name] = drv[key] - spawned
    actors = [a["actor_made"] for a in records.get("actor", []) if a.get("actor_made")]
    if actors:
        out["actors_made"] = max(actors) - spawned
    floor = (records.get("floor") or [None])[0]
    if floor:
        out.update(ray_imported=floor["ray_imported"] - spawned, cluster_up=floor["ray_init"] - spawned,
                   actors_made=floor["actor_ready"] - spawned, cluster_down=floor["ray_shutdown"] - spawned)
    ranks = records.get("rank", [])
    # the probe's record (the SFT job), else pg_rank.py's own (--job pg: "script", "joined", "ran")
    for keys, name in ((("probe", "script"), "ranks_up"), (("torch",), "torch_imported"),
                       (("rendezvous", "joined"), "rendezvous")):
        vals = [next((r[k] for k in keys if r.get(k)), None) for r in ranks]
        if ranks and all(v is not None for v in vals):
            out[name] = max(vals) - spawned
    firsts = [r["steps"][0][0] if r.get("steps") else r.get("ran") for r in ranks if r.get("steps") or r.get("ran")]
    if firsts and len(firsts) == len(ranks):
        out["first_step"] = max(firsts) - spawned
    if wall is not None:
        out["exit"] = wall
    return out


def segments(marks: dict[str, float]) -> dict[str, float]:
    """Where each second went: each milestone's time minus the previous one's (in MILESTONES order, skipping the
    ones this run did not go through; the first is counted from the spawn). They add up to the last milestone."""
    out, last = {}, 0.0
    for name, _ in MILESTONES:
        if name in marks:
            out[name] = marks[name] - last
            last = marks[name]
    return out


def _load(folder: Path) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {"rank": ph.load(folder)}
    for kind in ("driver", "actor", "floor"):
        out[kind] = []
        for p in sorted(folder.glob(f"{kind}-*.json")):
            try:
                out[kind].append(json.loads(p.read_text()))
            except (OSError, ValueError):
                pass
    return out


def job_command(job: str, variant: str, tiny: Path, out: Path, steps: int, nproc: int) -> list[str]:
    """`variant`'s command line for the SFT job (`steps` steps) or for benchmarks/benchlib/pg_rank.py (`job` "pg")."""
    if job == "pg":
        cmd = command(variant, [], nproc)
        cmd[cmd.index(str(SCRIPT))] = str(BENCH / "benchlib" / "pg_rank.py")
        return cmd
    return command(variant, script_args(tiny, out, steps), nproc)


# -- the session -------------------------------------------------------------------------------------------------

def run_session(ns: argparse.Namespace) -> tuple[list[Run], dict]:
    work = Path(tempfile.mkdtemp(prefix="sub", dir="/tmp"))
    logs = Path(ns.keep_logs) if ns.keep_logs else work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    info = noise.machine()
    info.update(load_before=noise.loadavg(), steps=ns.steps, reps=ns.reps, nproc=ns.nproc)
    if ns.job == "pg":
        info["steps"] = "1 (benchmarks/benchlib/pg_rank.py: one all_reduce, not examples/sft.py)"
    tiny = work / "tiny"
    subprocess.run([sys.executable, str(REPO / "examples" / "make_tiny_model.py"), "--out", str(tiny)], check=True,
                   capture_output=True)
    base = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "DUALRUN_BENCH_UNSHARED")}
    base.update(ACCELERATE_USE_CPU="true", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    runs: list[Run] = []
    t0 = time.monotonic()
    try:
        # untimed: the page cache, and dualrun's on-disk cache of accelerate's env for this config and env (a user's
        # second launch of a config; the first pays accelerate's import, about 1 s, see the report)
        for v in ("torchrun", "dualrun-torchrun"):
            env = ph.probe_env(base, work / "warm")
            (work / "warm").mkdir(exist_ok=True)
            measure(Run("warmup", -1), job_command(ns.job, v, tiny, work / "warm-out", 2, ns.nproc), env, REPO,
                    logs / f"warmup-{v}.log", ns.timeout)
        order = list(ns.variants)
        for rep in range(ns.reps):
            for variant in order[rep % len(order):] + order[:rep % len(order)]:
                probe = work / "probe" / f"{variant}-{rep}"
                probe.mkdir(parents=True)
                env = ph.probe_env(base, probe)
                ray_tmp = None
                if variant in FLOORS or variant == "dualrun-ray-embedded":
                    ray_tmp = tempfile.mkdtemp(prefix="sue", dir="/tmp")   # no one else's `ray start` to find
                    env["RAY_TMPDIR"] = ray_tmp
                if variant in FLOORS:
                    cmd = [sys.executable, str(BENCH / "benchlib" / "ray_floor.py")] + (["--lean"] if variant.endswith("lean")
                                                                            else [])
                else:
                    cmd = job_command(ns.job, variant, tiny, work / "out" / f"{variant}-{rep}", ns.steps, ns.nproc)
                busy = noise.wait_quiet(ns.quiet_cores, ns.quiet_wait)
                run = measure(Run(variant, rep, busy_before=busy), cmd, env, REPO, logs / f"{variant}-{rep}.log",
                              ns.timeout)
                recs = _load(probe)
                if variant in FLOORS:
                    run.ok = run.exit_code == 0 and bool(recs["floor"])
                    run.error = None if run.ok else run.error or f"exit code {run.exit_code}"
                elif ns.job == "pg":   # no trainer summary line: ok when it exited 0 and every rank recorded
                    timed_out = (run.error or "").startswith("timed out")
                    run.ok = run.exit_code == 0 and len(recs["rank"]) == ns.nproc and not timed_out
                    run.error = None if run.ok else run.error
                elif run.ok and len(recs["rank"]) != ns.nproc:
                    run.ok, run.error = False, f"{len(recs['rank'])} of {ns.nproc} ranks left a probe record"
                run.phases = milestones(run.spawned, run.wall_s, recs) if run.spawned else None
                runs.append(run)
                if ray_tmp:
                    shutil.rmtree(ray_tmp, ignore_errors=True)
                m = run.phases or {}
                print(f"rep {rep + 1}/{ns.reps} {variant:21s} ranks up {fmt(m.get('ranks_up'))} first step "
                      f"{fmt(m.get('first_step'))} actor {fmt(m.get('actors_made'))} wall {fmt(run.wall_s)} s  "
                      f"load {run.load_1m:.2f} busy {busy:.2f}  {'ok' if run.ok else 'FAILED: ' + str(run.error)}",
                      flush=True)
        busy = sorted(r.busy_before for r in runs if r.busy_before is not None)
        if busy:
            info["busy"] = f"median {statistics.median(busy):.2f}, min {busy[0]:.2f}, max {busy[-1]:.2f}"
    finally:
        info["load_after"] = noise.loadavg()
        info["session_s"] = round(time.monotonic() - t0, 1)
        shutil.rmtree(work, ignore_errors=True)
    return runs, info


# -- the report (pure) -------------------------------------------------------------------------------------------

def _stats(vals: list[float]) -> tuple[float, float, float] | None:
    return (statistics.median(vals), min(vals), max(vals)) if vals else None


def _cell(st: tuple[float, float, float] | None) -> str:
    return "-" if st is None else f"{st[0]:.2f} ({st[1]:.2f}–{st[2]:.2f})"


def per_variant(runs: list[Run], variants: list[str], of: str) -> dict[str, dict[str, tuple | None]]:
    """variant -> milestone -> (median, min, max) over its successful runs, of the milestones (`of`="marks") or of
    the segments (`of`="segments")."""
    out = {}
    for v in variants:
        rows = [(r.phases if of == "marks" else segments(r.phases)) for r in runs if r.variant == v and r.ok
                and r.phases]
        out[v] = {name: _stats([row[name] for row in rows if name in row]) for name, _ in MILESTONES}
    return out


def targets(marks: dict[str, dict[str, tuple | None]]) -> list[tuple[str, str, str, bool | None]]:
    """(target, measured, limit, met) rows from the medians."""
    med = lambda v, m: (marks.get(v, {}).get(m) or (None,))[0]  # noqa: E731
    out = []
    a, b = med("dualrun-torchrun", "first_step"), med("torchrun", "first_step")
    out.append(("dualrun --backend torchrun: first step − bare torchrun's", "-" if a is None or b is None else
                f"{a - b:+.2f} s", "≤ 0.20 s", None if a is None or b is None else a - b <= 0.2))
    for floor in FLOORS:
        a, b = med("dualrun-ray-embedded", "ranks_up"), med(floor, "actors_made")
        out.append((f"dualrun --backend ray (embedded): ranks up − actor answered in {VARIANTS[floor]}",
                    "-" if a is None or b is None else f"{a - b:+.2f} s", "≤ 1.00 s",
                    None if a is None or b is None else a - b <= 1.0))
    return out


def report(runs: list[Run], info: dict, variants: list[str], command_line: str, fake: bool) -> str:
    marks = per_variant(runs, variants, "marks")
    segs = per_variant(runs, variants, "segments")
    head = "| | " + " | ".join(VARIANTS[v] for v in variants) + " |"
    rule = "|---|" + "---:|" * len(variants)
    md = [f"# Start-up to the first step, phase by phase{' (FAKE NUMBERS: --fake)' if fake else ''}", "",
          f"Command: `{command_line}` — written {time.strftime('%Y-%m-%d %H:%M')}", "",
          "## Targets", "", "| target | measured (medians) | limit | met |", "|---|---:|---:|---|"]
    for name, got, limit, met in targets(marks):
        md.append(f"| {name} | {got} | {limit} | {'-' if met is None else 'PASS' if met else 'FAIL'} |")
    md += ["", "## When: seconds after the launcher's spawn", "",
           "Median (min–max) over the successful runs; `-` where a launcher does not go through that milestone.", "",
           head, rule]
    md += [f"| {label} | " + " | ".join(_cell(marks[v][name]) for v in variants) + " |" for name, label in MILESTONES]
    md += ["", "## Where each second goes: seconds from the previous milestone to this one", "",
           "Each column adds up to its exit time (medians need not add up exactly).", "", head, rule]
    md += [f"| {label} | " + " | ".join(_cell(segs[v][name]) for v in variants) + " |" for name, label in MILESTONES]
    md += ["", "## Machine", "", machine_md(info), "", "## Every run", "",
           "| rep | launcher | ok | load 1m | busy cores before | " + " | ".join(n for n, _ in MILESTONES) + " |",
           "|---:|---|---|---:|---:|" + "---:|" * len(MILESTONES)]
    for r in runs:
        m = r.phases or {}
        md.append(f"| {r.rep + 1} | {r.variant} | {'yes' if r.ok else 'no: ' + str(r.error)[:200]} | "
                  f"{fmt(r.load_1m)} | {fmt(r.busy_before)} | " + " | ".join(fmt(m.get(n)) for n, _ in MILESTONES)
                  + " |")
    return "\n".join(md) + "\n"


def fake_runs(variants: list[str], reps: int) -> list[Run]:
    """Synthetic runs (seeded): the report's code paths without starting anything."""
    rnd = random.Random(0)
    chains = {"torchrun": {"programs_started": 0.9, "ranks_up": 1.0, "torch_imported": 4.5, "rendezvous": 7.0,
                           "first_step": 8.0, "exit": 12.0},
              "dualrun-torchrun": {"dualrun_imported": 0.05, "job_checked": 0.1, "accelerate_env": 0.15,
                                   "programs_started": 1.0, "ranks_up": 1.1, "torch_imported": 4.6,
                                   "rendezvous": 7.1, "first_step": 8.1, "exit": 12.1},
              "dualrun-ray-embedded": {"dualrun_imported": 0.05, "job_checked": 0.1, "accelerate_env": 0.15,
                                       "ray_imported": 0.4, "cluster_up": 2.5, "placed": 2.7, "actors_made": 3.0,
                                       "programs_started": 3.1, "ranks_up": 3.2, "torch_imported": 6.6,
                                       "rendezvous": 9.0, "first_step": 10.0, "cluster_down": 14.5, "exit": 14.6},
              "ray-floor": {"ray_imported": 0.8, "cluster_up": 6.0, "actors_made": 6.5, "cluster_down": 8.0,
                            "exit": 8.2},
              "ray-floor-lean": {"ray_imported": 0.8, "cluster_up": 3.0, "actors_made": 3.5, "cluster_down": 5.0,
                                 "exit": 5.2}}
    runs = []
    for rep in range(reps):
        for v in variants:
            f = rnd.uniform(0.97, 1.03)
            run = Run(v, rep, True, 0, chains[v]["exit"] * f, load_1m=1.0, busy_before=0.1)
            run.phases = {k: t * f for k, t in chains[v].items()}
            runs.append(run)
    return runs


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(p, variants=VARIANTS, steps=10, steps_help="training steps per run (start-up is what is measured)",
                    quiet_cores=0.5, quick_help="2 repetitions (a smoke run)",
                    fake_help="synthetic numbers: write the report, start nothing")
    p.add_argument("--job", choices=("sft", "pg"), default="sft",
                   help="sft: examples/sft.py on the tiny model; pg: benchmarks/benchlib/pg_rank.py (torch, the gloo group, "
                   "one all_reduce: the first step), seconds a run, so more repetitions fit")
    p.add_argument("--out", default=str(RESULTS / "startup.md"), help="the report's path")
    ns = p.parse_args(argv)
    if ns.quick:
        ns.reps = 2
    ns.variants = chosen_variants(p, ns.variants, VARIANTS)
    command_line = ("python benchmarks/startup_bench.py " + " ".join(argv)).strip()
    if ns.fake:
        info = noise.machine()
        info.update(load_before=noise.loadavg(), load_after=noise.loadavg(), steps=ns.steps, reps=ns.reps,
                    nproc=ns.nproc, busy="median 0.10 (fake)")
        runs = fake_runs(ns.variants, ns.reps)
    else:
        ensure_loopback_only(argv)
        runs, info = run_session(ns)
    text = report(runs, info, ns.variants, command_line, ns.fake)
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text + f"\nwrote {out}")
    return 0 if all(r.ok for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
