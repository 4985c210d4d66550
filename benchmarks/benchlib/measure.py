"""One launcher run, measured from outside the launcher (a fresh process per run, so no launcher can hide a cost
inside the measuring process): wall time, time to the first loss line, the trainer's steps/s, the launcher's own
peak RSS and CPU, and the CPU of every process it started by kind; then the ranks' own view from the probe."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from . import phases as ph
from .job import SCRIPT, VARIANTS
from .noise import loadavg

ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class Run:
    """What one run of one launcher measured (None where it could not be measured: a failed run keeps its row)."""

    variant: str
    rep: int
    ok: bool = False
    exit_code: int | None = None
    wall_s: float | None = None
    first_step_s: float | None = None
    steps_per_s: float | None = None          # trainer's train_steps_per_second (worker-side)
    observed_steps_per_s: float | None = None  # loss lines per second on the launcher's output (driver-side)
    loss_lines: int = 0
    train_loss: str | None = None
    driver_rss_mib: float | None = None
    driver_cpu_s: float | None = None
    load_1m: float | None = None
    busy_before: float | None = None           # cores other jobs kept busy in the second before the run
    error: str | None = None
    spawned: float | None = None               # time.time() at the launcher's spawn (the probe's clock)
    steady_steps_per_s: float | None = None    # probe: steps/s after the first 10% of steps, slowest rank
    step_cpu_ms: float | None = None           # probe: median CPU time of a rank's process per step
    phases: dict | None = None                 # probe: seconds after spawn per phase (phases.PHASES)
    threads: str | None = None                 # probe: torch threads etc. inside the ranks
    machinery_cores: float | None = None       # CPU cores used by everything but the ranks while they trained
    tree_cpu: list | None = None               # (time.time(), CPU s of this script's descendants), every 0.5 s
    tree_split: list | None = None             # (time.time(), {kind: CPU s}) at the same times
    machinery_split: dict | None = None        # cores per kind of process (not ranks) while the ranks trained
    own_cores: float | None = None             # ... of it, dualrun's: all of it, but a running cluster's daemons


def proc_stats(pid: int) -> tuple[float | None, float | None]:
    """(VmHWM MiB, utime+stime s) of one process, or None where it is gone."""
    hwm = cpu = None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) / 1024
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        pass
    return hwm, cpu


def process_kind(pid: int) -> str:
    """What a process is, from its command line: a rank, a Ray actor, a Ray daemon, or the launcher's own."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return "launcher"
    if cmd.startswith("ray::"):
        return "ray actors"
    if any(k in cmd for k in (" -m dualrun launch ", " -m torch.distributed.run ", "ray_train_driver.py")):
        return "launcher"   # before the ranks' test: a launcher's own command line names the script too
    if "dualrun.rank.bootstrap" in cmd or str(SCRIPT) in cmd:
        return "ranks"
    if any(k in cmd for k in ("gcs_server", "raylet", "/ray/dashboard/", "/ray/_private/", "/ray/autoscaler/")):
        return "ray daemons"
    return "launcher"


def descendants(root: int) -> tuple[set[int], dict[int, int]]:
    """The live descendants of `root` (not `root` itself), and every live process's utime+stime in clock ticks,
    read from /proc in one pass."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                f = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(d.name)], ticks[int(d.name)] = int(f[1]), int(f[11]) + int(f[12])
    children: dict[int, list[int]] = {}
    for c, pp in parents.items():
        children.setdefault(pp, []).append(c)
    mine: set[int] = set()
    todo = [root]
    while todo:
        kids = [c for c in children.get(todo.pop(), []) if c not in mine]
        mine.update(kids)
        todo += kids
    return mine, ticks


def descendants_cpu(root: int | None = None, by_kind: dict | None = None) -> float:
    """CPU seconds (user+system) of every live descendant of `root` (default: this process), not `root` itself:
    the launcher, its workers, and the running cluster this script started (GCS, raylet, actors). With `by_kind`,
    also fill it with the seconds per kind of process (`process_kind`)."""
    mine, ticks = descendants(os.getpid() if root is None else root)
    hz = os.sysconf("SC_CLK_TCK")
    if by_kind is not None:
        for p in mine:
            k = process_kind(p)
            by_kind[k] = by_kind.get(k, 0.0) + ticks[p] / hz
    return sum(ticks[p] for p in mine) / hz


def measure(run: Run, cmd: list[str], env: dict[str, str], cwd: Path, log: Path, timeout: float) -> Run:
    """Spawn the launcher, timestamp every output line ('\\n' or '\\r'), sample its own RSS and CPU, wait."""
    lines: list[tuple[float, str]] = []
    lock = threading.Lock()
    run.load_1m = loadavg()[0]
    run.spawned = time.time()
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)

    def read(pipe) -> None:
        buf = b""
        while True:
            chunk = pipe.read1(65536)
            if not chunk:
                break
            now = time.monotonic() - t0
            buf += chunk
            parts = re.split(rb"\r\n|\r|\n", buf)
            buf = parts.pop()
            with lock:
                lines.extend((now, p.decode("utf-8", "replace")) for p in parts)
        if buf:
            with lock:
                lines.append((time.monotonic() - t0, buf.decode("utf-8", "replace")))

    stats: dict[str, float] = {}

    tree: list[tuple[float, float]] = []
    split: list[tuple[float, dict]] = []
    run.tree_cpu, run.tree_split = tree, split

    def sample() -> None:
        i = 0
        while proc.poll() is None:
            hwm, cpu = proc_stats(proc.pid)
            if hwm is not None:
                stats["hwm"] = hwm
            if cpu is not None:
                stats["cpu"] = cpu
            if i % 10 == 0:   # every 0.5 s: the CPU of everything this benchmark started (see add_probe)
                kinds: dict = {}
                tree.append((time.time(), descendants_cpu(by_kind=kinds)))
                split.append((tree[-1][0], kinds))
            i += 1
            time.sleep(0.05)

    threads = [threading.Thread(target=read, args=(p,), daemon=True) for p in (proc.stdout, proc.stderr)]
    threads.append(threading.Thread(target=sample, daemon=True))
    for t in threads:
        t.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        run.error = f"timed out after {timeout:g} s"
    run.wall_s = time.monotonic() - t0
    for t in threads:
        t.join(timeout=10)
    try:
        os.killpg(proc.pid, 9)  # anything the launcher left in its session
    except (ProcessLookupError, PermissionError):
        pass
    run.exit_code = proc.returncode
    run.driver_rss_mib = stats.get("hwm")
    run.driver_cpu_s = stats.get("cpu")
    lines.sort(key=lambda x: x[0])
    log.write_text("".join(f"{t:8.3f} {ANSI.sub('', s)}\n" for t, s in lines))
    parse_output(run, lines)
    run.ok = run.exit_code == 0 and run.error is None and run.steps_per_s is not None
    if not run.ok and run.error is None:
        tail = [s for _, s in lines if s.strip()][-3:]
        run.error = f"exit code {run.exit_code}: " + " | ".join(ANSI.sub("", s).strip()[:200] for s in tail)
    return run


def parse_output(run: Run, lines: list[tuple[float, str]]) -> None:
    """From the timestamped output: the first loss line, the loss-line rate after the first 10%, and the trainer's
    own summary (train_steps_per_second, train_loss)."""
    loss_t = []
    for t, s in lines:
        s = ANSI.sub("", s)
        if "{'loss':" in s:
            loss_t.append(t)
        elif "{'train_runtime':" in s:
            try:
                d = ast.literal_eval(s[s.index("{'train_runtime':"):s.rindex("}") + 1])
                run.steps_per_s = float(d["train_steps_per_second"])
                run.train_loss = str(d.get("train_loss"))
            except (ValueError, SyntaxError, KeyError):
                pass
    run.loss_lines = len(loss_t)
    if loss_t:
        run.first_step_s = loss_t[0]
        k = max(1, len(loss_t) // 10)
        if len(loss_t) - k >= 2 and loss_t[-1] > loss_t[k]:
            run.observed_steps_per_s = (len(loss_t) - 1 - k) / (loss_t[-1] - loss_t[k])



def add_probe(run: Run, records: list[dict], nproc: int) -> None:
    """The ranks' own view of the run (benchmarks/probe/): steady steps/s, CPU per step, phases, threads."""
    if len(records) != nproc or run.spawned is None:
        return
    steady = ph.run_steady(records)
    if steady:
        run.steady_steps_per_s, run.step_cpu_ms = steady["steps_per_s"], steady["cpu_ms"]
    run.phases = ph.phases(records, run.spawned, run.spawned + run.wall_s if run.wall_s else None)
    run.threads = ph.threads(records)
    run.machinery_split = ph.split_cores(records, run.tree_split or [])
    run.machinery_cores = ph.machinery_from_split(run.machinery_split)
    if run.machinery_cores is None:   # Ray Train: the ranks run inside the actors
        run.machinery_cores = ph.machinery_cores(records, run.tree_cpu or [])
    elif run.variant.startswith("dualrun"):   # a running cluster's daemons are the cluster's, there before the job
        joined = VARIANTS[run.variant][1]
        run.own_cores = run.machinery_cores - (run.machinery_split.get("ray daemons", 0.0) if joined else 0.0)
    run.tree_cpu = run.tree_split = None

