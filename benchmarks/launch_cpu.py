"""Where a launch's CPU goes, by process: `dualrun launch` with the server dualrun starts (the F run of
startup_side_by_side.py), to the first logged step, every process of its tree sampled (benchlib/proctree.py).

    python benchmarks/launch_cpu.py --runs grpo:torchrun,gkd:ray --reps 2
    python benchmarks/launch_cpu.py --code before=/tmp/base,after=.    # two checkouts of dualrun, alternated

`--code LABEL=PATH,...`: the launches alternate between these checkouts (each put first on PYTHONPATH), so a cut is
measured before and after in the same session. Writes results/launch_cpu.md (`--fake`: from made-up rows).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from benchlib.noise import loadavg  # noqa: E402
from benchlib.proctree import TreeSampler  # noqa: E402
from benchlib.sandbox import ensure_loopback_only  # noqa: E402
from startup_side_by_side import FIRST_STEP, PYTHON_OF, config, script  # noqa: E402

# (label, test on the command line), first match wins; the root process is the `dualrun launch` driver
KINDS = [
    ("vLLM engine core", re.compile(r"^VLLM::EngineCore|EngineCore|multiprocessing\.spawn|from multiprocessing")),
    ("vLLM API server", re.compile(r"vllm\.entrypoints")),
    ("teacher server (dualrun's CPU engine)", re.compile(r"dualrun\.programs\.cpu_engine")),
    ("router (dualrun)", re.compile(r"dualrun\.programs\.router")),
    ("ray gcs_server", re.compile(r"gcs_server")),
    ("ray raylet", re.compile(r"/raylet ")),
    ("ray dashboard agent", re.compile(r"dashboard/agent\.py|DashboardAgent")),
    ("ray API server (dashboard.py)", re.compile(r"dashboard/dashboard\.py|ray-dashboard")),
    ("ray runtime env agent", re.compile(r"runtime_env/agent|RuntimeEnvAgent")),
    ("ray log monitor", re.compile(r"log_monitor")),
    ("ray autoscaler monitor", re.compile(r"monitor\.py")),
    ("ray actor (rank / server actor)", re.compile(r"^ray::|default_worker\.py")),
    ("trainer rank (dualrun.rank.bootstrap + script)", re.compile(r"dualrun\.rank\.bootstrap")),
    ("compiler (g++/cc1plus: torch inductor)", re.compile(r"g\+\+|cc1plus")),
    ("pip / pyenv (vLLM collect_env for /server_info)", re.compile(r"pip|pyenv")),
]


def kind(row: dict, root: int) -> str:
    if row["pid"] == root:
        return "dualrun launch driver"
    for label, test in KINDS:
        if test.search(row["cmd"]):
            return label
    return "other: " + row["cmd"][:40]


def run_once(method: str, backend: str, tiny: Path, work: Path, log: Path, code: str) -> dict:
    """One F launch to its first logged step: (seconds, {kind: CPU-seconds}, every process)."""
    (work / "job.yaml").write_text(config(method, tiny))
    env = _env(code)
    t0 = time.monotonic()
    proc = subprocess.Popen([PYTHON_OF[method], "-m", "dualrun", "launch", "--backend", backend, "--config_file",
                             "job.yaml", *script(method, tiny, work / "out")], cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    sampler = TreeSampler(proc.pid)
    seen: list[float] = []
    procs: list[dict] = []

    def read() -> None:
        assert proc.stdout is not None
        with log.open("w") as f:
            for line in proc.stdout:
                f.write(f"{time.monotonic() - t0:8.2f} {line}")
                if not seen and FIRST_STEP.search(line):
                    seen.append(time.monotonic() - t0)
                    procs.extend(sampler.stop())
                    os.killpg(proc.pid, signal.SIGTERM)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        reader.join(timeout=30)
        sampler.stop()
        for row in sampler.processes():   # whatever of the tree outlived the driver (Ray's daemons)
            try:
                os.kill(row["pid"], 0)
            except OSError:
                continue
            if _start_of(row["pid"]) == row["start"]:
                os.kill(row["pid"], signal.SIGKILL)
    if not seen:
        raise RuntimeError(f"{method} on {backend}: no step was logged; see {log}")
    by_kind: dict[str, float] = {}
    kinds = {row["pid"]: kind(row, proc.pid) for row in procs}
    for row in procs:
        k = kinds[row["pid"]]
        if k.startswith("other") and row.get("ppid") in kinds:
            k = f"other, started by the {kinds[row['ppid']]}"
        by_kind[k] = by_kind.get(k, 0.0) + row["cpu_s"]
    return {"F": seen[0], "cpu": by_kind, "procs": procs}


def _env(code: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TRL_EXPERIMENTAL_SILENCE="1",
               PYTHONPATH=os.pathsep.join([code, *filter(None, [os.environ.get("PYTHONPATH", "")])]))
    env.pop("RAY_ADDRESS", None)
    return env


def warm(method: str, tiny: Path, work: Path, code: str) -> None:
    """A dry run first: it fills the cache of accelerate's env (keyed by PYTHONPATH among others) that every later
    launch of the same setup reads, as a user's second launch would."""
    (work / "job.yaml").write_text(config(method, tiny))
    subprocess.run([PYTHON_OF[method], "-m", "dualrun", "launch", "--dry_run", "--backend", "torchrun",
                    "--config_file", "job.yaml", *script(method, tiny, work / "out")], cwd=work, env=_env(code),
                   capture_output=True, timeout=300, check=True)


def _start_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def report(rows: list[dict], info: dict, command: str) -> str:
    out = ["# Where a launch's CPU goes, by process", "",
           f"`{command}` ({info['when']}; {info['cpus']} cores; load average at the start {info['load']:.1f}, "
           f"at the end {info['load_end']:.1f}).", "",
           "F launches (dualrun starts the server) to the first logged step; every process of the launch's tree, "
           "its user + system CPU-seconds from /proc every 0.2 s. Each cell: the median of the repetitions.", ""]
    for run in dict.fromkeys(r["run"] for r in rows):
        codes = list(dict.fromkeys(r["code"] for r in rows if r["run"] == run))
        mine = {c: [r for r in rows if r["run"] == run and r["code"] == c] for c in codes}
        kinds = sorted({k for r in rows if r["run"] == run for k in r["cpu"]},
                       key=lambda k: -max(statistics.median(r["cpu"].get(k, 0.0) for r in mine[c]) for c in codes))
        out += [f"## {run}", "", "| process | " + " | ".join(f"{c} CPU-s" for c in codes) + " |",
                "|---|" + "---:|" * len(codes)]
        for k in kinds:
            out.append(f"| {k} | " + " | ".join(f"{statistics.median(r['cpu'].get(k, 0.0) for r in mine[c]):.2f}"
                                                 for c in codes) + " |")
        out.append("| **all** | " + " | ".join(f"**{statistics.median(sum(r['cpu'].values()) for r in mine[c]):.1f}**"
                                              for c in codes) + " |")
        out.append("| F s (wall) | " + " | ".join(f"{statistics.median(r['F'] for r in mine[c]):.1f}" for c in codes)
                   + " |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", default="grpo:torchrun,gkd:ray", help="method:backend, ...")
    p.add_argument("--code", default=f"this={REPO}", help="LABEL=PATH,...: dualrun checkouts to alternate")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--tiny", default=str(Path(tempfile.gettempdir()) / "dualrun-bench-tiny-vllm"))
    p.add_argument("--out", default=str(HERE / "results" / "launch_cpu.md"))
    p.add_argument("--json", default=None, help="also write every run's rows (every process) here")
    p.add_argument("--logs", default=None)
    args = p.parse_args(argv)
    ensure_loopback_only(argv)
    tiny = Path(args.tiny)
    if not (tiny / "data" / "gkd.jsonl").exists():
        subprocess.run([sys.executable, str(REPO / "examples" / "make_tiny_model.py"), "--vllm", "--out", str(tiny)],
                       check=True, capture_output=True)
    codes = dict(c.split("=", 1) for c in args.code.split(","))
    logs = Path(args.logs or tempfile.mkdtemp(prefix="launch-cpu-"))
    logs.mkdir(parents=True, exist_ok=True)
    info = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(), "load": loadavg()[0]}
    rows = []
    for run in args.runs.split(","):
        for path in codes.values():
            work = Path(tempfile.mkdtemp(prefix="lcpu-warm-"))
            warm(run.split(":")[0], tiny, work, str(Path(path).resolve()))
            shutil.rmtree(work, ignore_errors=True)
    for rep in range(args.reps):
        for run in args.runs.split(","):
            method, backend = run.split(":")
            order = list(codes.items()) if rep % 2 == 0 else list(codes.items())[::-1]
            for label, path in order:
                work = Path(tempfile.mkdtemp(prefix=f"lcpu-{method}-"))
                try:
                    r = run_once(method, backend, tiny, work, logs / f"{method}-{backend}-{label}-{rep}.log",
                                 str(Path(path).resolve()))
                finally:
                    shutil.rmtree(work, ignore_errors=True)
                rows.append({"run": f"{method} on {backend}", "code": label, "rep": rep, "load": loadavg()[0], **r})
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "procs"}), flush=True)
    info["load_end"] = loadavg()[0]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    Path(args.out).write_text(report(rows, info, "python benchmarks/launch_cpu.py " + " ".join(argv)))
    print(f"wrote {args.out} (logs in {logs})")


if __name__ == "__main__":
    main()
