"""A/B of the steady-state steps/s gap: bare torchrun against dualrun's workers, one variable at a time.

    python benchmarks/steady_ab.py --reps 5 --steps 200          # --quick: 3 reps x 60 steps

Every variant runs the same unchanged examples/sft.py (tiny model, 2 processes, gloo) with the worker-side probe
(benchmarks/probe/), interleaved A, B, C, ... per repetition. Measured inside the ranks, so output transport and
start-up do not count: steps/s after the first 10% of steps (slowest rank), the median step, and the median CPU
time per step of a rank's whole process (all threads), which tells "slower because it burns more CPU" (threads,
spinning, extra work) from "slower because it waits" (load, transport). Variants:

  bare             python -m torch.distributed.run --nproc-per-node 2 examples/sft.py ...
  bare+env         the same, plus every variable a dualrun worker has that a bare one lacks or has otherwise
                   (taken from a first untimed dualrun run's probe; rank/run-id variables excluded)
  bare+bootstrap   torchrun -m dualrun.rank.bootstrap examples/sft.py ...: dualrun's entry point (runpy, import hooks,
                   trainer defaults, exit guard) under bare torchrun's env
  dualrun          dualrun launch --backend torchrun --config_file configs/sft_cpu.yaml examples/sft.py ...
  dualrun-ray      dualrun launch --backend ray ... against a running local cluster (started here, stopped after)

Writes results/steady_ab.md (summary, every run, env diff, load average per run).
"""
from __future__ import annotations

import argparse
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
from benchlib.job import SCRIPT, script_args
from benchlib.job import command as launcher_command
from benchlib.report import fmt
from benchlib.sandbox import ensure_loopback_only

VARIANTS = ("bare", "bare+env", "bare+bootstrap", "dualrun", "dualrun-ray")
# differ per rank/run by construction, not by launcher choice
_PER_RUN = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
            "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_RESTART_COUNT", "DUALRUN_RUN_ID", "DUALRUN_BENCH_PHASES",
            "PYTHONPATH", "_", "PWD", "OLDPWD", "SHLVL")


def command(variant: str, args: list[str], nproc: int) -> list[str]:
    if variant in ("bare", "bare+env"):
        return launcher_command("torchrun", args, nproc)
    if variant == "bare+bootstrap":
        cmd = launcher_command("torchrun", args, nproc)
        i = cmd.index(str(SCRIPT))
        return cmd[:i] + ["-m", "dualrun.rank.bootstrap"] + cmd[i:]
    return launcher_command("dualrun-torchrun" if variant == "dualrun" else "dualrun-ray", args, nproc)


def env_diff(a: dict[str, str], b: dict[str, str]) -> dict[str, str | None]:
    """What `b` sets (or unsets: None) relative to `a`, without the per-run variables."""
    out: dict[str, str | None] = {}
    for k in sorted(set(a) | set(b)):
        if k in _PER_RUN or k.startswith("DUALRUN_BENCH"):
            continue
        if a.get(k) != b.get(k):
            out[k] = b.get(k)
    return out


def one(variant: str, rep: int, env: dict[str, str], args: list[str], nproc: int, work: Path,
        timeout: float) -> dict:
    folder = work / f"probe-{variant}-{rep}"
    folder.mkdir(parents=True)
    load = os.getloadavg()[0]
    spawned = time.time()
    proc = subprocess.run(command(variant, args, nproc), env=ph.probe_env(env, folder), cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    exited = time.time()
    records = ph.load(folder)
    row = {"variant": variant, "rep": rep, "ok": proc.returncode == 0 and len(records) == nproc, "load": load,
           "wall": exited - spawned, "records": records, "steady": ph.run_steady(records),
           "threads": ph.threads(records)}
    if not row["ok"]:
        row["error"] = f"exit {proc.returncode}: " + (proc.stderr or proc.stdout)[-400:].replace("\n", " | ")
    shutil.rmtree(folder, ignore_errors=True)
    return row


def _cell(vals: list[float], digits: int = 1) -> str:
    if not vals:
        return "-"
    return f"{statistics.median(vals):.{digits}f} ({min(vals):.{digits}f}–{max(vals):.{digits}f})"


def report(rows: list[dict], variants: list[str], diff: dict, info: dict) -> str:
    base = [r["steady"]["steps_per_s"] for r in rows if r["variant"] == "bare" and r["ok"] and r["steady"]]
    base_med = statistics.median(base) if base else None
    out = ["| variant | n | steps/s (steady, slowest rank) | ×bare | step ms | CPU ms per step (per rank) | "
           "CPU cores per rank | train begin → first step ms | threads inside the ranks |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for v in variants:
        ok = [r for r in rows if r["variant"] == v and r["ok"] and r["steady"]]
        sps = [r["steady"]["steps_per_s"] for r in ok]
        ratio = f"{statistics.median(sps) / base_med:.3f}x" if sps and base_med else "-"
        out.append(f"| {v} | {len(ok)} | {_cell(sps)} | {ratio} | {_cell([r['steady']['step_ms'] for r in ok])} | "
                   f"{_cell([r['steady']['cpu_ms'] for r in ok])} | "
                   f"{_cell([r['steady']['cpu_per_wall'] for r in ok], 2)} | "
                   f"{_cell([r['steady']['first_ms'] for r in ok if r['steady']['first_ms'] is not None], 0)} | "
                   f"{'; '.join(sorted({r['threads'] for r in ok})) or '-'} |")
    out += ["", "Each cell: median (min–max) over the repetitions.", "",
            "Variables a dualrun worker has and a bare torchrun worker has not (or has otherwise), applied to "
            "`bare+env`:", ""]
    from dualrun.env.worker import is_secret   # a token that differs is named, never printed

    out += [(f"- `{k}` set (value redacted)" if is_secret(k) else f"- `{k}={v!r}`") if v is not None
            else f"- `{k}` unset" for k, v in diff.items()] or ["- none"]
    out += ["", "Every run (in order):", "", "| rep | variant | ok | steps/s | step ms | CPU ms/step | first step ms | "
            "wall s | load 1m |", "|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        s = r["steady"] or {}
        out.append(f"| {r['rep'] + 1} | {r['variant']} | {'yes' if r['ok'] else 'no: ' + r.get('error', '')[:200]} "
                   f"| {fmt(s.get('steps_per_s'))} | {fmt(s.get('step_ms'))} | {fmt(s.get('cpu_ms'))} | "
                   f"{r['wall']:.1f} | {r['load']:.2f} |")
    out += ["", f"Machine: {info.get('cpus')} CPUs, load average before {info['load_before']}, after "
                f"{info['load_after']}; {info['steps']} steps per run, {info['reps']} repetitions; torch "
                f"{info.get('torch')}, git {info.get('git')}."]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--variants", default="bare,bare+env,bare+bootstrap,dualrun")
    p.add_argument("--quick", action="store_true", help="3 repetitions of 60 steps")
    p.add_argument("--out", default=str(RESULTS / "steady_ab.md"))
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--keep", default=None, metavar="FILE", help="also write every run's probe records (JSON)")
    ns = p.parse_args(argv)
    if ns.quick:
        ns.reps, ns.steps = 3, 60
    variants = [v.strip() for v in ns.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        p.error(f"unknown variant(s) {bad}: choose from {', '.join(VARIANTS)}")
    ensure_loopback_only(sys.argv[1:] if argv is None else argv)
    info = noise.machine()
    info.update(load_before=" / ".join(f"{x:.2f}" for x in os.getloadavg()), steps=ns.steps, reps=ns.reps)
    work = Path(tempfile.mkdtemp(prefix="sab", dir="/tmp"))
    cluster = RunningCluster(4)
    try:
        tiny = work / "tiny"
        subprocess.run([sys.executable, str(REPO / "examples" / "make_tiny_model.py"), "--out", str(tiny)],
                       check=True, capture_output=True)
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "DUALRUN_BENCH_UNSHARED")}
        env.update(ACCELERATE_USE_CPU="true", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        if "dualrun-ray" in variants:
            cluster.start()
            env["RAY_ADDRESS"] = cluster.address
        # untimed: warms the page cache and gives both workers' env for the diff
        warm = {v: one(v, -1, env, script_args(tiny, work / f"w-{v}", 4), ns.nproc, work, ns.timeout)
                for v in ("bare", "dualrun")}
        for v, r in warm.items():
            if not r["ok"]:
                sys.exit(f"steady_ab: the warm-up run of {v} failed: {r.get('error')}")
        diff = env_diff(warm["bare"]["records"][0]["env"], warm["dualrun"]["records"][0]["env"])
        env_plus = dict(env)
        for k, v in diff.items():
            if v is None:
                env_plus.pop(k, None)
            else:
                env_plus[k] = v
        rows = []
        for rep in range(ns.reps):
            order = variants[rep % len(variants):] + variants[:rep % len(variants)]
            for v in order:
                args = script_args(tiny, work / "out" / f"{v}-{rep}", ns.steps)
                r = one(v, rep, env_plus if v == "bare+env" else env, args, ns.nproc, work, ns.timeout)
                rows.append(r)
                s = r["steady"] or {}
                print(f"rep {rep + 1} {v:15s} steps/s {fmt(s.get('steps_per_s'))} step ms "
                      f"{fmt(s.get('step_ms'))} cpu ms {fmt(s.get('cpu_ms'))} wall {r['wall']:.1f} "
                      f"load {r['load']:.2f} {'ok' if r['ok'] else r.get('error')}", flush=True)
                shutil.rmtree(work / "out" / f"{v}-{rep}", ignore_errors=True)
    finally:
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
    info["load_after"] = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    text = report(rows, variants, diff, info)
    if ns.keep:
        import json

        Path(ns.keep).write_text(json.dumps(rows, default=str))
    Path(ns.out).write_text(f"# Steady-state A/B (worker side)\n\nCommand: `python benchmarks/steady_ab.py "
                            f"{' '.join(sys.argv[1:] if argv is None else argv)}` — written "
                            f"{time.strftime('%Y-%m-%d %H:%M')}\n\n{text}\n")
    print(text)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
