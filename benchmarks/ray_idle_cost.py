"""Ray's idle cost: CPU an idle local cluster's processes and N idle actors use, Ray's defaults against lean.

    unshare -n bash -c 'ip link set lo up; python benchmarks/ray_idle_cost.py'   # 3 reps x 30 s, 2 actors

Four variants, each in a fresh child process, interleaved (every repetition runs each once, order rotated):

- **embedded-before**: what dualrun's embedded cluster was before it was made lean: `ray.init(address="local",
  include_dashboard=False, log_to_driver=False)`, usage stats off.
- **embedded-dualrun**: `dualrun.backends.ray.connect.connect` with `ray.address: local` (the lean node: no log
  monitor, no autoscaler monitor, no metrics export or task events, the agent's stats scan once a minute).
- **running-default**: a `ray start --head --include-dashboard=false`-like head node (`ray.cluster_utils`),
  joined as dualrun joins one (`log_to_driver=False`).
- **running-lean**: the same head node with the settings docs/concepts.md gives for `ray start`.

CPU is counted in CPU seconds (utime+stime from /proc/<pid>/stat, by pid), not wall: the machine is shared and
its load changes how long things take, not how much CPU an idle loop burns. Per process: the child (driver) and
every live descendant (GCS, raylet, agents, monitors, actors), over `--seconds` after `--settle` s of quiet.
Writes benchmarks/results/ray_idle.md (`--out`) with the command, the machine and its load, and prints the table.
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

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

VARIANTS = ("embedded-before", "embedded-dualrun", "running-default", "running-lean")
# (what the command line holds, the name in the table); first match wins
KINDS = (("gcs_server", "GCS"), ("raylet/raylet", "raylet"), ("DashboardAgent", "dashboard agent"),
         ("dashboard/agent.py", "dashboard agent"), ("RuntimeEnvAgent", "runtime-env agent"),
         ("runtime_env/agent", "runtime-env agent"), ("dashboard/dashboard.py", "API server"),
         ("log_monitor.py", "log monitor"), ("autoscaler/_private/monitor.py", "autoscaler monitor"),
         ("ray_process_reaper", "reaper"), ("ray::Idle", "idle actors"), ("ray::IDLE", "idle pool workers"))


def kind_of(cmdline: str, is_root: bool) -> str:
    """What a process is, from its command line (the names above); the measuring child itself is the driver."""
    if is_root:
        return "driver"
    for needle, name in KINDS:
        if needle in cmdline:
            return name
    return "other"


def tree_ticks(root: int) -> dict[int, tuple[int, str]]:
    """{pid: (utime+stime ticks, command line)} of `root` and every live descendant."""
    from benchlib.measure import descendants

    mine, ticks = descendants(root)
    mine.add(root)
    out = {}
    for p in mine:
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
        except OSError:
            cmd = "?"
        out[p] = (ticks.get(p, 0), cmd)
    return out


def _start(variant: str, temp_dir: str):
    """Start the variant's cluster and connect this process; returns what `_stop` needs."""
    import logging

    import ray

    import importlib

    rc = importlib.import_module("dualrun.backends.ray.connect")   # the package's `connect` is the function

    if variant == "embedded-before":
        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
        ray.init(address="local", num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1",
                 log_to_driver=False, logging_level=logging.WARNING)
        return None
    if variant == "embedded-dualrun":
        from dualrun.config.model import RayOptions

        return rc.connect(RayOptions(address="local"), "ray_idle_cost", num_cpus=4)
    from ray.cluster_utils import Cluster

    args = dict(num_cpus=4, node_ip_address="127.0.0.1", include_dashboard=False, temp_dir=temp_dir)
    if variant == "running-lean":   # what `ray start --include-log-monitor=False --no-monitor --system-config` does
        os.environ.update(rc.LEAN_ENV)
        args.update(rc.LEAN_NODE_PARAMS, _system_config=dict(rc.LEAN_SYSTEM_CONFIG))
    else:
        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    cluster = Cluster(initialize_head=True, head_node_args=args)
    ray.init(address=cluster.address, log_to_driver=False, logging_level=logging.WARNING)
    return cluster


def one(variant: str, actors: int, seconds: float, settle: float) -> dict:
    """Child mode: start `variant`, `actors` idle actors, measure; the result as a dict (printed as JSON)."""
    import ray

    temp_dir = tempfile.mkdtemp(prefix="ric", dir="/tmp")
    os.makedirs(os.path.join(temp_dir, "ray"))
    os.environ["RAY_TMPDIR"] = temp_dir   # no `ray start` of anyone else is found or written
    t = time.monotonic()
    handle = _start(variant, temp_dir)
    start_s = time.monotonic() - t
    try:
        @ray.remote(num_cpus=0.001)
        class Idle:
            def pid(self) -> int:
                return os.getpid()

        held = [Idle.remote() for _ in range(actors)]
        ray.get([a.pid.remote() for a in held])
        time.sleep(settle)
        me = os.getpid()
        before, t0 = tree_ticks(me), time.monotonic()
        time.sleep(seconds)
        after, window = tree_ticks(me), time.monotonic() - t0
        hz = os.sysconf("SC_CLK_TCK")
        procs = [{"pid": p, "kind": kind_of(cmd, p == me), "cpu_s": (tk - before.get(p, (0, ""))[0]) / hz,
                  "cmd": cmd[:160]} for p, (tk, cmd) in sorted(after.items())]
        return {"variant": variant, "start_s": round(start_s, 2), "window_s": round(window, 2), "procs": procs,
                "load": os.getloadavg()}
    finally:
        if hasattr(handle, "close"):
            handle.close()
        else:
            ray.shutdown()
            if handle is not None:
                handle.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def cores_by_kind(run: dict) -> dict[str, float]:
    out: dict[str, float] = {}
    for p in run["procs"]:
        out[p["kind"]] = out.get(p["kind"], 0.0) + p["cpu_s"] / run["window_s"]
    return out


def _med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}–{max(xs):.3f})" if xs else "–"


def table(runs: list[dict]) -> str:
    """Cores per kind of process and in all, median (min–max) over the repetitions, one column per variant; a
    kind a variant does not run shows '–'."""
    variants = [v for v in VARIANTS if any(r["variant"] == v for r in runs)]
    per = {v: [cores_by_kind(r) for r in runs if r["variant"] == v] for v in variants}
    kinds = [k for _, k in KINDS] + ["driver", "other"]
    kinds = [k for i, k in enumerate(kinds) if k not in kinds[:i] and any(k in c for cs in per.values() for c in cs)]
    head = "| process | " + " | ".join(f"{v} (n={len(per[v])})" for v in variants) + " |"
    lines = [head, "|---|" + "---:|" * len(variants)]
    for k in kinds:
        cells = [_med([c[k] for c in per[v] if k in c]) if any(k in c for c in per[v]) else "–" for v in variants]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    lines.append("| **all** | " + " | ".join(f"**{_med([sum(c.values()) for c in per[v]])}**" for v in variants)
                 + " |")
    daemons = [_med([sum(x for k, x in c.items() if k not in ("idle actors", "driver")) for c in per[v]])
               for v in variants]
    lines.append("| Ray's daemons (all but actors and driver) | " + " | ".join(daemons) + " |")
    starts = [_med([r["start_s"] for r in runs if r["variant"] == v]) for v in variants]
    lines.append("| start-up s (wall, loaded machine) | " + " | ".join(starts) + " |")
    return "\n".join(lines)


def runs_md(runs: list[dict]) -> str:
    lines = ["| # | variant | cores (all) | processes | window s | load 1m |", "|---:|---|---:|---:|---:|---:|"]
    for i, r in enumerate(runs, 1):
        lines.append(f"| {i} | {r['variant']} | {sum(cores_by_kind(r).values()):.3f} | {len(r['procs'])} | "
                     f"{r['window_s']:.1f} | {r['load'][0]:.1f} |")
    return "\n".join(lines)


def write(runs: list[dict], out: Path, command: str, info: dict, load0: tuple, load1: tuple, ns) -> str:
    md = "\n".join([
        "# Ray's idle cost", "",
        f"Command: `{command}` — written {time.strftime('%Y-%m-%d %H:%M')}", "",
        f"Cores (CPU seconds per second, user+system, by pid) each kind of process used over a {ns.seconds:g} s "
        f"window with {ns.actors} idle actors (`num_cpus=0.001`), {ns.settle:g} s after they answered; median "
        "(min–max) over the repetitions. Each variant ran in a fresh process, interleaved.", "",
        table(runs), "",
        "Every run (in order):", "", runs_md(runs), "",
        f"Machine: {info.get('cpus')} CPUs ({info.get('cpu', '?')}), {info.get('mem_total_gib', '?')} GiB; "
        f"load average before {load0[0]:.2f} / {load0[1]:.2f} / {load0[2]:.2f}, after {load1[0]:.2f} / "
        f"{load1[1]:.2f} / {load1[2]:.2f} (other engineers' jobs share the machine); ray {info.get('ray')}, "
        f"Python {info.get('python')}, git {info.get('git', '?')}.", ""])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(md)
    return md


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--actors", type=int, default=2)
    p.add_argument("--seconds", type=float, default=30.0, help="the measured idle window")
    p.add_argument("--settle", type=float, default=5.0, help="quiet time before the window (start-up settles)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of: " + ", ".join(VARIANTS))
    p.add_argument("--out", type=Path, default=HERE / "results" / "ray_idle.md")
    p.add_argument("--one", help=argparse.SUPPRESS)   # child mode: one variant, prints its JSON
    argv = sys.argv[1:] if argv is None else argv
    ns = p.parse_args(argv)
    if ns.one:
        print("RESULT " + json.dumps(one(ns.one, ns.actors, ns.seconds, ns.settle)), flush=True)
        return 0
    from benchlib.noise import machine
    from benchlib.sandbox import ensure_loopback_only

    ensure_loopback_only(argv)
    variants = [v.strip() for v in ns.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        p.error(f"--variants: unknown {bad}; expected some of {list(VARIANTS)}")
    info, load0, runs = machine(), os.getloadavg(), []
    for rep in range(ns.reps):
        order = variants[rep % len(variants):] + variants[:rep % len(variants)]
        for v in order:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--one", v, "--actors", str(ns.actors),
                   "--seconds", str(ns.seconds), "--settle", str(ns.settle)]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=ns.seconds + ns.settle + 240)
            got = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
            if res.returncode != 0 or not got:
                print(f"rep {rep + 1} {v}: failed (rc {res.returncode}): {res.stderr.strip()[-1500:]}", flush=True)
                continue
            run = json.loads(got[-1][len("RESULT "):])
            runs.append(run)
            print(f"rep {rep + 1} {v}: {sum(cores_by_kind(run).values()):.3f} cores, "
                  f"{ {k: round(x, 3) for k, x in sorted(cores_by_kind(run).items())} }, load {run['load'][0]:.1f}",
                  flush=True)
    command = "python benchmarks/ray_idle_cost.py " + " ".join(argv)
    print(write(runs, ns.out, command.strip(), info, load0, os.getloadavg(), ns))
    return 0 if runs else 1


if __name__ == "__main__":
    sys.exit(main())
