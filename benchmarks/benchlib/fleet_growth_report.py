"""fleet_growth.py's report from its repetitions' numbers (pure: tested on fake numbers), and those fake numbers.

Why apart: the run takes minutes of vLLM engines; the tables, the ratios and what each number means are checked
without starting anything (tests/e2e/test_benchmarks.py).

One repetition's numbers (`rep`; a failed one: {load, failed: its one line}):
  load                     1-min load average when it began
  syncs {"n": [s, ...]}    seconds of each timed weight sync with n members (the fleet's first sync, and each one
                           that re-formed the group, left out)
  reforms [{members, s}]   the syncs that re-formed the group (the first with new members)
  rss_gib {"n": GiB}       the job's processes' resident memory with n replicas
  joins [{to, serving_s: [..], engine_s: [..], cli_s, steps_during}]   each grow: every joined replica's
                           "serving N s after the resize asked for it" and "its engine started in N s", the CLI's wall
                           (`dualrun scale` spawned -> its answer), the trainer's steps meanwhile
  skipped [n]              sizes not grown to (the machine's memory)
  restart {to, stop_s, serving_s, step_s, healthy_s, killed_after_step, resumed}   SIGTERM -> the old job gone,
                           -> the restarted job's first sync done, -> its first step past the last one logged before;
                           its servers' start-up from its own line; the step logged before the kill, the checkpoint
  fixed_syncs [s, ...]     the restarted job's syncs (a fixed fleet of `to`)
  step_before_s            the trainer's median step (end to end) at 1 member, just before the first grow
"""
from __future__ import annotations

import statistics
from typing import Iterable


def spread(xs: Iterable[float | None], digits: int = 2, unit: str = "") -> str:
    """`median (min–max)` of the numbers given, `-` when there are none."""
    v = [x for x in xs if x is not None]
    if not v:
        return "-"
    f = f"{{:.{digits}f}}"
    return f"{f.format(statistics.median(v))}{unit} ({f.format(min(v))}–{f.format(max(v))})"


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _join(rep: dict, to: int) -> dict | None:
    return next((j for j in rep.get("joins", []) if j["to"] == to), None)


def ratios_to_one(reps: list[dict], n: int) -> list[float]:
    """Per repetition, its median sync with n members over its median with 1 (the same job: the same run)."""
    out = []
    for rep in reps:
        one, many = _median(rep["syncs"].get("1", [])), _median(rep["syncs"].get(str(n), []))
        if one and many is not None:
            out.append(many / one)
    return out


def restart_over_join(reps: list[dict]) -> list[float]:
    """Per repetition: kill -> the restarted job's fleet serving the weights, over the grow's ask -> serving."""
    out = []
    for rep in reps:
        join, restart = _join(rep, rep["restart"]["to"]) if rep.get("restart") else None, rep.get("restart")
        if join and restart and restart.get("serving_s") and join["serving_s"]:
            out.append(restart["serving_s"] / max(join["serving_s"]))
    return out


def training_lost(rep: dict) -> tuple[float | None, float | None]:
    """Seconds of training lost (join, restart), at the trainer's pace before the grow (`step_before_s`): the join's
    time less the steps it took meanwhile (slower steps, not a pause); the restart's time to its next step less the
    one step it would have taken, plus the steps it redid."""
    step, rs = rep.get("step_before_s"), rep.get("restart") or {}
    join = _join(rep, rs.get("to", 2))
    if not step:
        return None, None
    lost_join = max(0.0, max(join["serving_s"]) - join["steps_during"] * step) if join else None
    lost_restart = None
    if rs.get("step_s") is not None:
        redone = rs["killed_after_step"] - rs["resumed"] if rs.get("resumed") is not None else 0
        lost_restart = rs["step_s"] - step + redone * step
    return lost_join, lost_restart


def report(every: list[dict], meta: dict) -> str:
    reps = [r for r in every if not r.get("failed")]   # a failed repetition: its row and its reason only
    sizes = sorted({int(n) for rep in reps for n in rep["syncs"]})
    to = reps[0]["restart"]["to"] if reps and reps[0].get("restart") else 2
    first = [_join(r, to) for r in reps]
    first = [j for j in first if j]
    restarts = [r["restart"] for r in reps if r.get("restart")]
    fake = " **FAKE NUMBERS** (`--fake`: the report's test; nothing was started)." if meta.get("fake") else ""
    lines = [
        "# A replica joining a running job against a whole-job restart; the weight sync after growth", "",
        f"`{meta['command']}` ({meta['when']}, {len(every)} repetitions"
        f"{f', {len(every) - len(reps)} failed' if len(every) > len(reps) else ''}).{fake}", "",
        "GRPO on `--backend torchrun`: TRL's unchanged `GRPOTrainer` (1 rank, `benchmarks/benchlib/fleet_rank.py`) "
        f"and a vLLM CPU rollout fleet ({meta['model']}). Each repetition is one job started with 1 replica "
        f"(`min_replicas: 1`, `max_replicas: {max(sizes) if sizes else '?'}`), grown with `dualrun scale rollout N` "
        "while it trains (standing for a node joining), then stopped with SIGTERM and launched again as a fixed "
        f"fleet of {to} resuming from its newest checkpoint (what a job that cannot grow does to use the new "
        "node). Every number below comes from that repetition's own run.", "",
        "## Join to serving against a whole-job restart", "",
        "| measurement | median (min–max) s |", "|---|---:|",
        f"| **grow 1 -> {to}: the ask -> the new replica in rotation holding the trainer's weights** (the "
        "supervisor's \"serving N s after the resize asked for it\": the engine started beside the others, held out "
        "of rotation until the next weight sync reached it, then taken in by the router) | "
        f"{spread(max(j['serving_s']) for j in first)} |",
        f"| of it, the new engine's start (spawn -> healthy, while the others served) | "
        f"{spread(max(j['engine_s']) for j in first)} |",
        f"| `dualrun scale rollout {to}` spawned -> its answer (the CLI's process and request on top) | "
        f"{spread(j['cli_s'] for j in first)} |",
        f"| steps the trainer took meanwhile (it never stopped) | {spread((j['steps_during'] for j in first), 0)} |",
        f"| **whole-job restart with {to} replicas: SIGTERM -> the restarted job's first weight sync done** (its "
        "replicas serving the checkpoint's weights) | "
        f"{spread(r.get('serving_s') for r in restarts)} |",
        "| SIGTERM -> the restarted job logs its first step past the last one logged before the kill | "
        f"{spread(r.get('step_s') for r in restarts)} |",
        f"| of it, the stop (SIGTERM -> the old launch exited, its workers and servers stopped) | {spread(r.get('stop_s') for r in restarts)} |",
        f"| of it, the fresh servers' start-up (the restarted launch's own line) | "
        f"{spread(r.get('healthy_s') for r in restarts)} |",
        f"| steps redone (last logged before the kill minus the checkpoint resumed; `save_steps: 1`) | "
        f"{spread((r['killed_after_step'] - r['resumed'] for r in restarts if r.get('resumed') is not None), 0)} |",
        f"| **restart / join**, per repetition (restart to serving over join to serving) | "
        f"{spread(restart_over_join(reps), 2, 'x')} |",
        f"| the trainer's step before the grow (1 member; the pace below is counted in) | "
        f"{spread(r.get('step_before_s') for r in reps)} |",
        f"| **training time lost to the join**: its time less the steps taken meanwhile at that pace | "
        f"{spread(training_lost(r)[0] for r in reps)} |",
        f"| **training time lost to the restart**: SIGTERM -> its next step, less one step, plus the steps redone | "
        f"{spread(training_lost(r)[1] for r in reps)} |", "",
        "## The weight sync with 1, 2 and 4 members after growth", "",
        "Each sync is TRL's `sync_weights` as the trainer calls it every step, timed in the rank (through the "
        "router's fan-out to every member: the update's start, dualrun's gloo stream down the chain of replicas, "
        "vLLM's load, the finish and the prefix-cache reset). The first sync of the job and each sync that re-formed "
        "the group (the first with new members) are left out and shown apart. Ratio: per repetition, its median "
        "at N over its median at 1 (the same job), then the median (min–max) of those.", "",
        "| members | syncs timed | s per sync, median (min–max) | / 1 member | the re-forming sync s | job's "
        "resident memory GiB |", "|---:|---:|---:|---:|---:|---:|"]
    for n in sizes:
        times = [s for r in reps for s in r["syncs"].get(str(n), [])]
        reform = [f["s"] for r in reps for f in r.get("reforms", []) if f["members"] == n]
        ratio = "1.00x" if n == 1 else spread(ratios_to_one(reps, n), 2, "x")
        lines.append(f"| {n} | {len(times)} | {spread(times, 3)} | {ratio} | {spread(reform, 3)} | "
                     f"{spread((r.get('rss_gib', {}).get(str(n)) for r in reps), 1)} |")
    fixed = [s for r in reps for s in r.get("fixed_syncs", [])]
    if fixed:
        lines += ["", f"The restarted job's fleet of {to} (started whole, not grown): {len(fixed)} syncs, "
                  f"{spread(fixed, 3)} s."]
    grows = sorted({j["to"] for r in reps for j in r.get("joins", [])} - {to})
    for n in grows:
        js = [j for j in (_join(r, n) for r in reps) if j]
        new = max(len(j["serving_s"]) for j in js)
        lines += ["", f"Grow {n - new} -> {n} ({new} new engine{'s started at once' if new > 1 else ''}): the ask -> "
                  f"the last new replica serving {spread(max(j['serving_s']) for j in js)} s, its engine's start "
                  f"{spread(max(j['engine_s']) for j in js)} s, the trainer's steps meanwhile "
                  f"{spread((j['steps_during'] for j in js), 0)}."]
    skipped = sorted({n for r in reps for n in r.get("skipped", [])})
    if skipped:
        lines += ["", f"Not grown to {', '.join(map(str, skipped))}: the machine's available memory was short "
                  f"(each vLLM CPU engine here needs about {meta.get('engine_gib', '?')} GiB)."]
    lines += ["", "## Every repetition", "",
              "| # | load 1 min | join s (engine s) | restart: stop / to serving / to the next step s | syncs "
              "medians s by members |", "|---:|---:|---:|---:|---|"]
    for i, r in enumerate(every):
        if r.get("failed"):
            lines.append(f"| {i} | {r['load']:.1f} | failed: {r['failed']} | | |")
            continue
        j, rs = _join(r, to), r.get("restart") or {}
        join = f"{max(j['serving_s']):.1f} ({max(j['engine_s']):.1f})" if j else "-"
        f = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
        meds = ", ".join(f"{n}: {_median(v):.3f}" for n, v in sorted(r["syncs"].items(), key=lambda kv: int(kv[0]))
                         if v)
        lines.append(f"| {i} | {r['load']:.1f} | {join} | {f(rs.get('stop_s'))} / {f(rs.get('serving_s'))} / "
                     f"{f(rs.get('step_s'))} | {meds} |")
    lines += ["", "## What was used and why", "", *meta.get("notes", []), "",
              f"- Machine: {meta.get('machine', '?')}. Load average at the start {meta.get('load_start', '?')}, at "
              f"the end {meta.get('load_end', '?')} (1/5/15 min); {meta.get('versions', '')}."]
    return "\n".join(lines) + "\n"


def fake_reps(reps: int) -> list[dict]:
    """Synthetic repetitions: a join of 20 s (engine 15 s), a restart of 60 s to serving, syncs of 0.1 s at 1
    member, 0.15 at 2, 0.25 at 4 (every repetition alike, +1 % each)."""
    out = []
    for i in range(reps):
        k = 1 + 0.01 * i
        out.append({"load": 1.0 + i, "syncs": {"1": [0.1 * k] * 3, "2": [0.15 * k] * 3, "4": [0.25 * k] * 3},
                    "reforms": [{"members": 2, "s": 0.5 * k}, {"members": 4, "s": 0.8 * k}],
                    "rss_gib": {"1": 3.0, "2": 4.5, "4": 7.5},
                    "joins": [{"to": 2, "serving_s": [20.0 * k], "engine_s": [15.0 * k], "cli_s": 20.5 * k,
                               "steps_during": 12},
                              {"to": 4, "serving_s": [30.0 * k, 31.0 * k], "engine_s": [25.0 * k, 26.0 * k],
                               "cli_s": 31.5 * k, "steps_during": 20}],
                    "skipped": [],
                    "restart": {"to": 2, "stop_s": 5.0 * k, "serving_s": 60.0 * k, "step_s": 62.0 * k,
                                "healthy_s": 40.0 * k, "killed_after_step": 30, "resumed": 30},
                    "fixed_syncs": [0.15 * k] * 3, "step_before_s": 1.0 * k})
    return out
