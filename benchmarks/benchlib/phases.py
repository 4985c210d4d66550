"""Worker-side phases and steady-state step times, from the probe's per-rank files (benchmarks/probe/).

Pure functions over the JSON the probe writes, shared by the launch report (phase table) and steady_ab.py (A/B of
the steady-state gap). No torch, no Ray.
"""
from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

PROBE_DIR = Path(__file__).resolve().parent.parent / "probe"
DIR_ENV = "DUALRUN_BENCH_PHASES"
# phase name -> what the time means (seconds after the launcher was spawned; the latest rank counts)
PHASES = (
    ("workers_started", "the last worker process started (its /proc start time)"),
    ("torch_imported", "`import torch` finished in the last rank"),
    ("rendezvous", "`init_process_group` returned in the last rank"),
    ("first_step", "the first optimizer step ended (last rank)"),
    ("last_step", "the last optimizer step ended (last rank)"),
    ("exit", "the launcher process exited"),
)
_KEYS = {"workers_started": "started", "torch_imported": "torch", "rendezvous": "rendezvous"}


def probe_env(env: dict[str, str], folder: Path) -> dict[str, str]:
    """`env` with the probe on PYTHONPATH (first) and its output folder set."""
    out = dict(env)
    out["PYTHONPATH"] = os.pathsep.join([str(PROBE_DIR)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    out[DIR_ENV] = str(folder)
    return out


def load(folder: Path) -> list[dict]:
    """Every rank's record (a rank that never reached train end left none)."""
    out = []
    for p in sorted(Path(folder).glob("rank-*.json")):
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            pass
    return sorted(out, key=lambda r: int(r.get("rank", 0)))


def steady(record: dict, skip: float = 0.1) -> dict | None:
    """One rank's steady state: steps after the first `skip` share. steps/s over that window, the median step
    (ms) and the median CPU time per step of the whole process (ms; all its threads: gloo's, OpenMP's)."""
    steps = record.get("steps") or []
    k = max(1, int(len(steps) * skip))
    if len(steps) - k < 3:
        return None
    window = steps[k:]
    walls = [b[0] - a[0] for a, b in zip(window, window[1:])]
    cpus = [b[1] - a[1] for a, b in zip(window, window[1:])]
    span = window[-1][0] - window[0][0]
    begin = record.get("train_begin")
    return {"steps_per_s": (len(window) - 1) / span if span > 0 else None,
            "first_ms": 1000 * (steps[0][0] - begin) if begin else None,
            "step_ms": 1000 * statistics.median(walls), "cpu_ms": 1000 * statistics.median(cpus),
            "cpu_per_wall": (window[-1][1] - window[0][1]) / span if span > 0 else None}


def run_steady(records: list[dict]) -> dict | None:
    """The job's steady state: the slowest rank's steps/s (the job goes at its pace), medians of the rest."""
    per = [s for s in (steady(r) for r in records) if s and s["steps_per_s"]]
    if not per:
        return None
    return {"steps_per_s": min(s["steps_per_s"] for s in per),
            "step_ms": max(s["step_ms"] for s in per),
            "cpu_ms": statistics.median(s["cpu_ms"] for s in per),
            "first_ms": max((s["first_ms"] for s in per if s["first_ms"] is not None), default=None),
            "cpu_per_wall": statistics.median(s["cpu_per_wall"] for s in per if s["cpu_per_wall"] is not None)}


def phases(records: list[dict], spawned: float, exited: float | None) -> dict[str, float | None]:
    """Seconds after the launcher's spawn (epoch `spawned`) at which each phase was reached by the last rank."""
    out: dict[str, float | None] = {}
    for name, _ in PHASES:
        if name == "exit":
            out[name] = None if exited is None else exited - spawned
            continue
        if name in ("first_step", "last_step"):
            vals = [r["steps"][0 if name == "first_step" else -1][0] for r in records if r.get("steps")]
        else:
            vals = [r[_KEYS[name]] for r in records if r.get(_KEYS[name]) is not None]
        out[name] = max(vals) - spawned if vals and len(vals) == len(records) else None
    return out


def _at(points: list[tuple[float, float]], t: float) -> float | None:
    """Linear interpolation of (time, value) samples at time `t` (None outside them)."""
    for (t0, v0), (t1, v1) in zip(points, points[1:]):
        if t0 <= t <= t1:
            return v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)
    return None


def machinery_cores(records: list[dict], tree: list[tuple[float, float]], skip: float = 0.1) -> float | None:
    """Cores kept busy by everything but the ranks while all of them were in their steady state: the launcher, its
    agent or actors, Ray's daemons. `tree` samples the CPU seconds of every process the benchmark started (ranks
    included); the ranks' own CPU comes from their steps. Independent of other jobs' load, unlike wall time."""
    if not records or any(len(r.get("steps") or []) < 4 for r in records) or len(tree) < 2:
        return None
    start = max(r["steps"][max(1, int(len(r["steps"]) * skip))][0] for r in records)
    end = min(r["steps"][-1][0] for r in records)
    a, b = _at(tree, start), _at(tree, end)
    if a is None or b is None or end - start < 1.0:
        return None
    ranks = 0.0
    for r in records:
        ra, rb = _at([(t, c) for t, c in r["steps"]], start), _at([(t, c) for t, c in r["steps"]], end)
        if ra is None or rb is None:
            return None
        ranks += rb - ra
    return max(0.0, (b - a) - ranks) / (end - start)


def split_cores(records: list[dict], split: list[tuple[float, dict]], skip: float = 0.1) -> dict | None:
    """Cores per kind of process (launcher, Ray actors, Ray daemons, ranks) over the same window as
    `machinery_cores`. For Ray Train the ranks run inside the actors: there "ray actors" includes them."""
    if not records or any(len(r.get("steps") or []) < 4 for r in records) or len(split) < 2:
        return None
    start = max(r["steps"][max(1, int(len(r["steps"]) * skip))][0] for r in records)
    end = min(r["steps"][-1][0] for r in records)
    if end - start < 1.0:
        return None
    out = {}
    for kind in sorted({k for _, d in split for k in d}):
        pts = [(t, d.get(kind, 0.0)) for t, d in split]
        a, b = _at(pts, start), _at(pts, end)
        if a is not None and b is not None:
            out[kind] = max(0.0, b - a) / (end - start)
    return out


def machinery_from_split(split: dict | None) -> float | None:
    """The launcher machinery's cores as the sum of its own processes' (every kind but the ranks), where the ranks
    are processes of their own; None where they are not (Ray Train). Summing ~0.05 cores directly is what makes
    it precise: `machinery_cores` takes it as a difference of two ~1.4-core numbers sampled at different instants,
    which moved it by ~0.02 between runs."""
    if not split or "ranks" not in split:
        return None
    return sum(v for k, v in split.items() if k != "ranks")


def threads(records: list[dict]) -> str:
    """torch threads / interop threads / OMP_NUM_THREADS / affinity, as seen inside the ranks (distinct values)."""
    seen = set()
    for r in records:
        t = r.get("threads") or {}
        seen.add(f"torch {t.get('torch')}, interop {t.get('interop')}, "
                 f"OMP_NUM_THREADS={t.get('env', {}).get('OMP_NUM_THREADS', 'unset')}, affinity {t.get('affinity')}")
    return "; ".join(sorted(seen)) or "-"
