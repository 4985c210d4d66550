"""Time from `dualrun launch` to the first logged training step with a separate server, against its limit.

    python benchmarks/startup_side_by_side.py                       # gkd (CPU engine teacher), both backends
    python benchmarks/startup_side_by_side.py --methods gkd,grpo    # + GRPO with a vLLM CPU rollout (.venv-vllm)

For each method and backend, in the same session, round robin:
  S  the server's own command (what `dualrun launch --dry_run` prints for it) alone: start to healthy (a fresh one
     for each backend's E: a job's weight-sync group is its own);
  E  the same job against that server already running (`roles.<name>.address`): launch to the first logged step;
  F  the job with dualrun starting the server: launch to the first logged step.
Started one after the other, F would be about S + E; started side by side it is about max(S, E). The target:
F <= 1.15 x max(S, E) + 3 s on this machine. Where both halves are CPU-bound on few cores (the CPU engine, vLLM's CPU
build), side by side cannot beat the cores either: the machine's busy CPU-seconds of S and of E (from /proc/stat:
run it on a quiet machine) over its cores is the other limit, and the report gives F against
max(S, E, (cpu S + cpu E) / cores) too. Every run is stopped once its first step is logged. Writes
results/startup_side_by_side.md (`--fake`: the report from made-up numbers, nothing started).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from benchlib.noise import busy_seconds, loadavg, machine  # noqa: E402
from benchlib.sandbox import ensure_loopback_only  # noqa: E402
from dualrun.light.interpreter import PYTHON  # noqa: E402

FIRST_STEP = re.compile(r"['\"]loss['\"]\s*:")   # HF Trainer's log of a step: {'loss': ..., ...}
ROLE = {"gkd": "teacher", "grpo": "rollout"}
# vLLM on a CPU as the vLLM tier runs it: eager float32, a short context, a 1 GiB KV cache (its default takes most of
# the machine's memory: the engine's worker was killed for it)
VLLM_ARGS = "[--enforce-eager, --dtype, float32, --max-model-len, '256', --max-num-seqs, '8']"
ROLE_ENV = {"gkd": {}, "grpo": {"VLLM_CPU_KVCACHE_SPACE": "1"}}   # the role's `env:`, which the dry run does not show
PYTHON_OF = {"gkd": sys.executable, "grpo": str(REPO / ".venv-vllm" / "bin" / "python")}   # GRPO's needs vLLM
SLACK, FIXED_S = 1.15, 3.0


def config(method: str, tiny: Path, address: str | None = None) -> str:
    """The job's config: the server dualrun starts, or (`address`) the one already running."""
    head = f"use_cpu: true\nmethod: {method}\nroles:\n  train: {{gpus: 2}}\n"
    if method == "gkd":
        role = (f"  teacher: {{address: '{address}', top_k: 5}}\n" if address else
                f"  teacher: {{gpus: 1, model: {tiny / 'teacher'}, top_k: 5, engine: transformers, "
                "health_timeout_s: 600}\n")
    else:
        role = (f"  rollout: {{address: '{address}'}}\n" if address else
                f"  rollout: {{gpus: 1, model: {tiny / 'model'}, engine: vllm, health_timeout_s: 600, "
                f"server_args: {VLLM_ARGS}, env: {{VLLM_CPU_KVCACHE_SPACE: '1'}}}}\n")
    return head + role


def script(method: str, tiny: Path, out: Path) -> list[str]:
    common = ["--output_dir", str(out), "--max_steps", "3", "--save_strategy", "no", "--logging_steps", "1"]
    if method == "gkd":
        return [str(REPO / "examples" / "gkd.py"), "--model_name_or_path", str(tiny / "model"),
                "--teacher_model_name_or_path", str(tiny / "teacher"), "--dataset_path",
                str(tiny / "data" / "gkd.jsonl"), *common]
    return [str(REPO / "examples" / "grpo.py"), "--model_name_or_path", str(tiny / "model"), "--dataset_path",
            str(tiny / "data" / "prompts.jsonl"), *common]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TRL_EXPERIMENTAL_SILENCE="1", **extra)
    env.pop("RAY_ADDRESS", None)   # the Ray runs start their embedded cluster, both E and F
    return env


def server_command(method: str, tiny: Path, work: Path, port: int) -> tuple[list[str], dict[str, str]]:
    """The server's command and env exactly as the launch's dry run prints them, on `port`."""
    (work / "job.yaml").write_text(config(method, tiny))
    r = subprocess.run([PYTHON_OF[method], "-m", "dualrun", "launch", "--backend", "torchrun", "--config_file",
                        "job.yaml", "--dry_run", *script(method, tiny, work / "out")], cwd=work, env=_env(),
                       capture_output=True, text=True, timeout=120)
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith(f"# {ROLE[method]} server 0,"))
    words = shlex.split(line.split(": ", 1)[1])
    env = dict(w.split("=", 1) for w in words if re.match(r"^[A-Z_][A-Z0-9_]*=", w))
    argv = [w.replace("<auto>", str(port)) for w in words if not re.match(r"^[A-Z_][A-Z0-9_]*=", w)]
    argv = [PYTHON_OF[method] if w == PYTHON else w for w in argv]   # the dry run names no interpreter path
    return argv, {**{k: v for k, v in env.items() if v}, **ROLE_ENV[method]}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(port: int) -> bool:
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
                f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def start_server(method: str, tiny: Path, work: Path, log: Path) -> tuple[subprocess.Popen, int, float, float]:
    """S: the server alone, started and waited for; (its process, port, seconds to healthy, busy CPU-seconds)."""
    port = _free_port()
    argv, env = server_command(method, tiny, work, port)
    t0, c0 = time.monotonic(), busy_seconds()
    # one machine: gloo (the weight sync) on loopback, as dualrun gives its own servers (`with_gloo`)
    proc = subprocess.Popen(argv, env=_env(**env, GLOO_SOCKET_IFNAME="lo"), stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    while not _healthy(port):
        if proc.poll() is not None or time.monotonic() - t0 > 900:
            raise RuntimeError(f"the {ROLE[method]} server did not start; see {log}")
        time.sleep(0.1)
    return proc, port, time.monotonic() - t0, busy_seconds() - c0


def _stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM the run's process group, then SIGKILL what is left of it: vLLM's engine core outlives its API
    server's SIGTERM (it was found running an hour later, 1.7 GB each)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    try:
        os.killpg(proc.pid, signal.SIGKILL)   # whatever of its group is left
    except ProcessLookupError:
        pass


def first_step(method: str, backend: str, tiny: Path, work: Path, log: Path,
               address: str | None = None) -> tuple[float, float]:
    """E (`address`: the server already runs) or F: seconds from `dualrun launch` to the first logged step, and the
    machine's busy CPU-seconds meanwhile."""
    (work / "job.yaml").write_text(config(method, tiny, address))
    t0, c0 = time.monotonic(), busy_seconds()
    proc = subprocess.Popen([PYTHON_OF[method], "-m", "dualrun", "launch", "--backend", backend, "--config_file",
                             "job.yaml", *script(method, tiny, work / "out")], cwd=work, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen: list[float] = []

    def read() -> None:
        assert proc.stdout is not None
        with log.open("w") as f:
            for line in proc.stdout:
                f.write(f"{time.monotonic() - t0:8.2f} {line}")
                if not seen and FIRST_STEP.search(line):
                    seen.extend((time.monotonic() - t0, busy_seconds() - c0))
                    os.killpg(proc.pid, signal.SIGTERM)   # the launcher stops everything it started

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=900)
    finally:
        _stop(proc)
        reader.join(timeout=30)
    if not seen:
        raise RuntimeError(f"{method} on {backend}: no step was logged; see {log}")
    return seen[0], seen[1]


def measure(methods: list[str], backends: list[str], reps: int, tiny: Path, logs: Path) -> list[dict]:
    """Round robin: per repetition, method and backend, S (a fresh server: a job's weight-sync group is its own,
    so no E job reuses another's server), E against it, then F."""
    rows = []
    for rep in range(reps):
        for method in methods:
            work = Path(tempfile.mkdtemp(prefix=f"sbs-{method}-"))
            for backend in backends:
                server, port, s, cpu_s = start_server(method, tiny, work, logs / f"{method}-{backend}-S-{rep}.log")
                try:
                    e, cpu_e = first_step(method, backend, tiny, work, logs / f"{method}-{backend}-E-{rep}.log",
                                          f"127.0.0.1:{port}")
                finally:
                    _stop(server)
                f, cpu_f = first_step(method, backend, tiny, work, logs / f"{method}-{backend}-F-{rep}.log")
                rows.append({"method": method, "backend": backend, "rep": rep, "S": s, "E": e, "F": f,
                             "cpu_S": cpu_s, "cpu_E": cpu_e, "cpu_F": cpu_f})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}–{max(values):.1f})"


def report(rows: list[dict], info: dict, command: str, fake: bool = False) -> str:
    out = ["# Start-up side by side: launch to the first logged step", ""]
    if fake:
        out += ["**FAKE numbers (`--fake`): the report's shape only; nothing was started.**", ""]
    out += [f"`{command}` ({info['when']}; dualrun {info['commit']}; {info['cpus']} cores; load average at the "
            f"start {info['load']:.1f}).", "",
            "S: the server's own command alone, start to healthy. E: the same job against that server already "
            "running (`roles.<name>.address`), launch to the first logged step. F: the job with dualrun starting "
            "the server. Each cell: the median of the repetitions (min–max). Target: F <= 1.15 x max(S, E) + 3 s.",
            "", "| method | backend | S s | E s | F s | S + E s | target s | F / max(S, E) | target |",
            "|---|---|---|---|---|---|---|---|---|"]
    for method in dict.fromkeys(r["method"] for r in rows):
        for backend in dict.fromkeys(r["backend"] for r in rows if r["method"] == method):
            mine = [r for r in rows if r["method"] == method and r["backend"] == backend]
            s, e, f = ([r[k] for r in mine] for k in ("S", "E", "F"))
            worst = max(statistics.median(s), statistics.median(e))
            target = SLACK * worst + FIXED_S
            ok = statistics.median(f) <= target
            out.append(f"| {method} | {backend} | {_cell(s)} | {_cell(e)} | {_cell(f)} | "
                       f"{statistics.median(s) + statistics.median(e):.1f} | {target:.1f} | "
                       f"{statistics.median(f) / worst:.2f} | {'PASS' if ok else 'FAIL'} |")
    if all("cpu_S" in r for r in rows):
        out += ["", "## Against the cores", "",
                "Both halves are CPU-bound here: the machine's busy CPU-seconds (/proc/stat) of S and of E, over its "
                f"{info['cpus']} cores, is what no start-up order can beat. Limit = max(S, E, (cpu S + cpu E) / "
                "cores); the same slack: F <= 1.15 x limit + 3 s.", "",
                "| method | backend | cpu S s | cpu E s | cpu F s | (cpu S + cpu E) / cores s | limit s | F s | "
                "F / limit | against the cores |", "|---|---|---|---|---|---|---|---|---|---|"]
        for method in dict.fromkeys(r["method"] for r in rows):
            for backend in dict.fromkeys(r["backend"] for r in rows if r["method"] == method):
                mine = [r for r in rows if r["method"] == method and r["backend"] == backend]
                med = {k: statistics.median(r[k] for r in mine) for k in ("S", "E", "F", "cpu_S", "cpu_E", "cpu_F")}
                bound = (med["cpu_S"] + med["cpu_E"]) / info["cpus"]
                limit = max(med["S"], med["E"], bound)
                ok = med["F"] <= SLACK * limit + FIXED_S
                out.append(f"| {method} | {backend} | {med['cpu_S']:.1f} | {med['cpu_E']:.1f} | {med['cpu_F']:.1f} | "
                           f"{bound:.1f} | {limit:.1f} | {med['F']:.1f} | {med['F'] / limit:.2f} | "
                           f"{'PASS' if ok else 'FAIL'} |")
    out += ["", "## On a GPU (arithmetic, not measured)", "",
            "With published start-up times of a vLLM engine (weights, CUDA graphs: 30-120 s) and of a trainer (model "
            "load, DeepSpeed/DDP set-up, dataset: 20-60 s), a launch that starts the server first waits S + E: "
            "50-180 s; side by side it waits max(S, E): 30-120 s, a saving of min(S, E) = 20-60 s on every launch "
            "and every whole-job restart (`max_failures`).", "", "## Every run", "",
            "| method | backend | rep | S s | E s | F s |", "|---|---|---|---|---|---|"]
    out += [f"| {r['method']} | {r['backend']} | {r['rep']} | {r['S']:.1f} | {r['E']:.1f} | {r['F']:.1f} |"
            for r in rows]
    return "\n".join(out) + "\n"


def _fake_rows(methods: list[str], backends: list[str], reps: int) -> list[dict]:
    return [{"method": m, "backend": b, "rep": r, "S": 20.0 + r, "E": 15.0 + r, "F": 22.0 + r, "cpu_S": 30.0,
             "cpu_E": 20.0, "cpu_F": 50.0}
            for r in range(reps) for m in methods for b in backends]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", default="gkd", help="gkd, grpo (grpo runs with --vllm-python: vLLM's CPU build)")
    p.add_argument("--vllm-python", default=PYTHON_OF["grpo"], help="the interpreter of the vLLM venv")
    p.add_argument("--backends", default="torchrun,ray")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--tiny", default=None, help="examples/make_tiny_model.py --vllm output (built when missing)")
    p.add_argument("--out", default=str(HERE / "results" / "startup_side_by_side.md"))
    p.add_argument("--logs", default=None, help="keep every run's output here (default: a temporary folder)")
    p.add_argument("--fake", action="store_true", help="write the report from made-up numbers; start nothing")
    args = p.parse_args(argv)
    methods, backends = args.methods.split(","), args.backends.split(",")
    PYTHON_OF["grpo"] = args.vllm_python
    info = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
            "load": loadavg()[0], "commit": subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                                           capture_output=True, text=True).stdout.strip() or "?"}
    command = "python benchmarks/startup_side_by_side.py " + " ".join(argv)
    if args.fake:
        Path(args.out).write_text(report(_fake_rows(methods, backends, args.reps), info, command, fake=True))
        return
    ensure_loopback_only(argv)
    tiny = Path(args.tiny) if args.tiny else Path(tempfile.gettempdir()) / "dualrun-bench-tiny-vllm"
    if not (tiny / "data" / "gkd.jsonl").exists():
        subprocess.run([sys.executable, str(REPO / "examples" / "make_tiny_model.py"), "--vllm", "--out", str(tiny)],
                       check=True, capture_output=True)
    logs = Path(args.logs or tempfile.mkdtemp(prefix="sbs-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    info.update(machine=machine())
    rows = measure(methods, backends, args.reps, tiny, logs)
    Path(args.out).write_text(report(rows, info, command))
    print(f"wrote {args.out} (logs in {logs})")


if __name__ == "__main__":
    main()
