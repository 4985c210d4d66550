"""Launch overhead and throughput: dualrun against bare torchrun and Ray Train, same tiny SFT, same session.

    python benchmarks/launch_bench.py                   # 5 reps x 200 steps; --quick: 2 x 60 (matplotlib: chart)

Runs the unchanged `examples/sft.py` (tiny offline model, 2 processes, gloo on CPU, a fixed number of steps)
through five launchers, interleaved round-robin per repetition:

  torchrun              python -m torch.distributed.run --nproc-per-node 2 examples/sft.py ...  (no dualrun)
  dualrun-torchrun      dualrun launch --backend torchrun --config_file configs/sft_cpu.yaml examples/sft.py ...
  ray-train             Ray Train TorchTrainer whose train_loop_per_worker runs the script with runpy
                        (benchmarks/ray_train_driver.py), against a running local cluster
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
(used by tests/test_benchmarks.py).
"""
from __future__ import annotations

import argparse
import ast
import os
import platform
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import phases as ph  # noqa: E402  (benchmarks/phases.py: the worker-side probe's records)

RESULTS = HERE / "results"
SCRIPT = REPO / "examples" / "sft.py"
CONFIG = REPO / "configs" / "sft_cpu.yaml"

VARIANTS = {  # name -> (label, needs the running cluster)
    "torchrun": ("bare torchrun", False),
    "dualrun-torchrun": ("dualrun --backend torchrun", False),
    "ray-train": ("Ray Train TorchTrainer (running cluster)", True),
    "dualrun-ray": ("dualrun --backend ray (running cluster)", True),
    "dualrun-ray-embedded": ("dualrun --backend ray (embedded, cold)", False),
}
SHORT = {"torchrun": "bare\ntorchrun", "dualrun-torchrun": "dualrun\ntorchrun", "ray-train": "Ray Train\n(running)",
         "dualrun-ray": "dualrun ray\n(running)", "dualrun-ray-embedded": "dualrun ray\n(embedded)"}
BASE = "torchrun"
# (variant, metric, limit, kind): kind "max" -> ratio <= limit, "min" -> ratio >= limit
TARGETS = [  # issue 14
    ("dualrun-torchrun", "wall", 1.05, "max"),
    ("dualrun-ray", "wall", 1.05, "max"),
    ("dualrun-ray-embedded", "wall", 1.5, "max"),
    ("dualrun-torchrun", "steps_per_s", 0.98, "min"),
    ("dualrun-ray", "steps_per_s", 0.98, "min"),
    ("dualrun-ray-embedded", "steps_per_s", 0.98, "min"),
]
README_START, README_END = "<!-- launch-table:start -->", "<!-- launch-table:end -->"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


# -- network namespace -------------------------------------------------------------------------------------------

def interfaces() -> set[str]:
    with open("/proc/net/dev") as f:  # the interfaces of this process's network namespace
        return {line.split(":")[0].strip() for line in f.readlines()[2:]}


def ensure_loopback_only(argv: list[str]) -> None:
    """Return only inside a loopback-only namespace with `lo` up; as root re-exec this program (sys.argv[0] with
    `argv`) under `unshare -n`; else exit with a message."""
    if interfaces() <= {"lo"}:
        # a fresh `unshare -n` has `lo` down (check with netlink: /sys may still show the old namespace)
        shown = subprocess.run(["ip", "-o", "link", "show", "lo"], capture_output=True, text=True).stdout
        if ",UP" not in shown and "<UP" not in shown:
            r = subprocess.run(["ip", "link", "set", "lo", "up"], capture_output=True, text=True)
            if r.returncode != 0:
                sys.exit(f"launch_bench: the loopback interface is down and `ip link set lo up` failed: "
                         f"{r.stderr.strip()}")
        return
    if os.environ.get("DUALRUN_BENCH_UNSHARED") != "1" and os.geteuid() == 0 and shutil.which("unshare"):
        env = dict(os.environ, DUALRUN_BENCH_UNSHARED="1")
        os.execvpe("unshare", ["unshare", "-n", "--", sys.executable, os.path.abspath(sys.argv[0]), *argv], env)
    sys.exit("launch_bench: refusing to run: this benchmark starts torchrun and Ray and must only see the loopback "
             f"interface, but this namespace has {sorted(interfaces())}. Run it as root (it re-executes itself "
             "under `unshare -n`) or inside `unshare -n bash -c 'ip link set lo up; python "
             "benchmarks/launch_bench.py ...'`.")


# -- machine -----------------------------------------------------------------------------------------------------

def machine() -> dict:
    info: dict = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        mem = {ln.split(":")[0]: int(ln.split()[1]) for ln in Path("/proc/meminfo").read_text().splitlines()
               if ln.split(":")[0] in ("MemTotal", "MemAvailable")}
        info["mem_total_gib"] = round(mem["MemTotal"] / 2**20, 1)
        info["mem_available_gib"] = round(mem["MemAvailable"] / 2**20, 1)
    except (OSError, KeyError, ValueError):
        pass
    from importlib.metadata import PackageNotFoundError, version

    for pkg in ("torch", "transformers", "trl", "accelerate", "datasets", "ray", "dualrun"):
        try:
            info[pkg] = version(pkg)
        except PackageNotFoundError:
            info[pkg] = "-"
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "dualrun", "plugins"], cwd=REPO,
                               capture_output=True, text=True)
        info["git"] = rev.stdout.strip() + (" (+ uncommitted changes in dualrun/)" if dirty.stdout.strip() else "")
    except OSError:
        pass
    return info


def loadavg() -> tuple[float, float, float]:
    return os.getloadavg()


def busy_cores(seconds: float = 1.0) -> float:
    """CPU cores busy over the next `seconds` (from /proc/stat). Called between runs, so it is other jobs' load
    (plus the idle running cluster, when it is up)."""
    def snap() -> tuple[int, int]:
        vals = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
        return sum(vals[:8]), idle

    t1, i1 = snap()
    time.sleep(seconds)
    t2, i2 = snap()
    return (os.cpu_count() or 1) * (1 - (i2 - i1) / max(1, t2 - t1))


def wait_quiet(limit: float, max_wait: float) -> float:
    """Wait (at most `max_wait` s) until other jobs use fewer than `limit` cores; return the last measurement."""
    deadline = time.monotonic() + max_wait
    while True:
        busy = busy_cores()
        if busy < limit or time.monotonic() >= deadline:
            return busy


# -- one run -----------------------------------------------------------------------------------------------------

@dataclass
class Run:
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


def _proc_stats(pid: int) -> tuple[float | None, float | None]:
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


def _kind(pid: int) -> str:
    """What a process is, from its command line: a rank, a Ray actor, a Ray daemon, or the launcher's own."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return "launcher"
    if cmd.startswith("ray::"):
        return "ray actors"
    if "dualrun.rank.bootstrap" in cmd or str(SCRIPT) in cmd:
        return "ranks"
    if any(k in cmd for k in ("gcs_server", "raylet", "/ray/dashboard/", "/ray/_private/", "/ray/autoscaler/")):
        return "ray daemons"
    return "launcher"


def descendants_cpu(root: int | None = None, by_kind: dict | None = None) -> float:
    """CPU seconds (user+system) of every live descendant of `root` (default: this process), not `root` itself:
    the launcher, its workers, and the running cluster this script started (GCS, raylet, actors). With `by_kind`,
    also fill it with the seconds per kind of process (`_kind`)."""
    root = os.getpid() if root is None else root
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
    mine, todo = set(), [root]
    while todo:
        kids = [c for c in children.get(todo.pop(), []) if c not in mine]
        mine.update(kids)
        todo += kids
    hz = os.sysconf("SC_CLK_TCK")
    if by_kind is not None:
        for p in mine:
            k = _kind(p)
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
            hwm, cpu = _proc_stats(proc.pid)
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
    log.write_text("".join(f"{t:8.3f} {_ANSI.sub('', s)}\n" for t, s in lines))
    parse_output(run, lines)
    run.ok = run.exit_code == 0 and run.error is None and run.steps_per_s is not None
    if not run.ok and run.error is None:
        tail = [s for _, s in lines if s.strip()][-3:]
        run.error = f"exit code {run.exit_code}: " + " | ".join(_ANSI.sub("", s).strip()[:200] for s in tail)
    return run


def parse_output(run: Run, lines: list[tuple[float, str]]) -> None:
    loss_t = []
    for t, s in lines:
        s = _ANSI.sub("", s)
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


# -- the running cluster -----------------------------------------------------------------------------------------

class RunningCluster:
    """A local single-node Ray cluster this script starts and stops (its own processes, its own temp dir)."""

    def __init__(self, cpus: int = 4) -> None:
        self.cpus = cpus
        self.cluster = None
        self.temp_dir = None
        self.address = None

    def start(self) -> float:
        from ray.cluster_utils import Cluster

        t = time.monotonic()
        self.temp_dir = tempfile.mkdtemp(prefix="lbc", dir="/tmp")
        self.cluster = Cluster(initialize_head=True, head_node_args=dict(
            num_cpus=self.cpus, node_ip_address="127.0.0.1", include_dashboard=False, temp_dir=self.temp_dir))
        self.address = self.cluster.address
        return time.monotonic() - t

    def idle_cores(self, seconds: float = 5.0) -> float:
        """Cores the idle cluster's own processes (GCS, raylet, its workers: this process's descendants) keep busy:
        what Ray takes from the ranks' CPUs before any job runs."""
        a = descendants_cpu()
        time.sleep(seconds)
        return (descendants_cpu() - a) / seconds

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None


# -- the session -------------------------------------------------------------------------------------------------

def script_args(tiny: Path, out: Path, steps: int) -> list[str]:
    return ["--model_name_or_path", str(tiny / "model"), "--dataset_path", str(tiny / "data" / "sft.jsonl"),
            "--output_dir", str(out), "--max_steps", str(steps), "--save_strategy", "no", "--seed", "1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(variant: str, args: list[str], nproc: int) -> list[str]:
    py = sys.executable
    if variant == "torchrun":
        return [py, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
                "--master-port", str(free_port()), str(SCRIPT), *args]
    if variant == "ray-train":
        return [py, str(HERE / "ray_train_driver.py"), "--num-workers", str(nproc), str(SCRIPT), *args]
    backend = "torchrun" if variant == "dualrun-torchrun" else "ray"
    return [py, "-m", "dualrun", "launch", "--backend", backend, "--config_file", str(CONFIG),
            "--num_processes", str(nproc), str(SCRIPT), *args]


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
    variants = ns.variants
    work = Path(tempfile.mkdtemp(prefix="lb", dir="/tmp"))
    logs = Path(ns.keep_logs) if ns.keep_logs else work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    info = machine()
    info["load_before"] = loadavg()
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
                busy = wait_quiet(ns.quiet_cores, ns.quiet_wait)
                run = measure(Run(variant, rep, busy_before=busy), cmd, env, REPO, logs / f"{variant}-{rep}.log",
                              ns.timeout)
                add_probe(run, ph.load(probe), ns.nproc)
                if ray_tmp:
                    shutil.rmtree(ray_tmp, ignore_errors=True)
                shutil.rmtree(work / "out" / f"{variant}-{rep}", ignore_errors=True)
                runs.append(run)
                status = "ok" if run.ok else f"FAILED ({run.error})"
                print(f"rep {rep + 1}/{ns.reps} {variant:22s} wall {run.wall_s:6.1f} s  first step "
                      f"{_f(run.first_step_s)} s  steps/s {_f(run.steps_per_s)}  driver RSS "
                      f"{_f(run.driver_rss_mib, 0)} MiB  load {run.load_1m:.2f}  busy before {busy:.2f} cores  "
                      f"{status}", flush=True)
        cluster.stop()
        info["cluster_start_s"] = [round(x, 1) for x in cluster_starts]
        info["cluster_idle_cores"] = [round(x, 3) for x in cluster_idle]
        busy = sorted(r.busy_before for r in runs if r.busy_before is not None)
        if busy:
            info["busy"] = f"median {statistics.median(busy):.2f}, min {busy[0]:.2f}, max {busy[-1]:.2f}"
    finally:
        cluster.stop()
        info["load_after"] = loadavg()
        info["session_s"] = round(time.monotonic() - t_start, 1)
        shutil.rmtree(work, ignore_errors=True)   # logs survive only in --keep-logs DIR
    return runs, info


def add_probe(run: Run, records: list[dict], nproc: int) -> None:
    """The ranks' own view of the run (benchmarks/probe/): steady steps/s, CPU per step, phases, threads."""
    if len(records) != nproc or run.spawned is None:
        return
    steady = ph.run_steady(records)
    if steady:
        run.steady_steps_per_s, run.step_cpu_ms = steady["steps_per_s"], steady["cpu_ms"]
    run.phases = ph.phases(records, run.spawned, run.spawned + run.wall_s if run.wall_s else None)
    run.threads = ph.threads(records)
    run.machinery_cores = ph.machinery_cores(records, run.tree_cpu or [])
    run.machinery_split = ph.split_cores(records, run.tree_split or [])
    run.tree_cpu = run.tree_split = None


def _split(split: dict | None) -> str:
    """' (launcher 0.002, ray actors 0.04, ...)': where the launcher machinery's cores went."""
    if not split:
        return ""
    return " (" + ", ".join(f"{k} {v:.3f}" for k, v in sorted(split.items()) if k != "ranks") + ")"


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


# -- summary, table, chart ---------------------------------------------------------------------------------------

METRICS = ("wall_s", "first_step_s", "steps_per_s", "steady_steps_per_s", "step_cpu_ms", "machinery_cores",
           "observed_steps_per_s", "driver_rss_mib", "driver_cpu_s")


def summarize(runs: list[Run], variants: list[str]) -> dict[str, dict]:
    out = {}
    for v in variants:
        ok = [r for r in runs if r.variant == v and r.ok]
        s: dict = {"n": len(ok), "failed": sum(1 for r in runs if r.variant == v and not r.ok)}
        for m in METRICS:
            vals = [getattr(r, m) for r in ok if getattr(r, m) is not None]
            s[m] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)} if vals else None
        s["train_loss"] = sorted({r.train_loss for r in ok if r.train_loss})
        out[v] = s
    base = out.get(BASE)
    for v, s in out.items():
        s["ratio"] = {}
        for m in METRICS:
            if base and base.get(m) and s.get(m) and base[m]["median"]:
                s["ratio"][m] = s[m]["median"] / base[m]["median"]
    return out


def targets(summary: dict[str, dict]) -> list[dict]:
    metric = {"wall": "wall_s", "steps_per_s": "steady_steps_per_s"}
    out = []
    for v, m, limit, kind in TARGETS:
        ratio = summary.get(v, {}).get("ratio", {}).get(metric[m])
        ok = None if ratio is None else (ratio <= limit if kind == "max" else ratio >= limit)
        out.append({"variant": v, "metric": m, "limit": limit, "kind": kind, "ratio": ratio, "pass": ok})
    return out


def _cell(s: dict, m: str, digits: int = 2) -> str:
    v = s.get(m)
    if not v:
        return "-"
    return f"{v['median']:.{digits}f} ({v['min']:.{digits}f}–{v['max']:.{digits}f})"


def _ratio(s: dict, m: str) -> str:
    r = s.get("ratio", {}).get(m)
    return "-" if r is None else f"{r:.2f}x"


def table(summary: dict[str, dict]) -> str:
    head = ("| launcher | n | wall s | ×bare | first step s | ×bare | steps/s (steady, in ranks) | ×bare | "
            "CPU ms per step | launcher CPU while training (cores) | steps/s (trainer) | steps/s (seen by driver) | "
            "driver peak RSS MiB | driver CPU s |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    rows = []
    for v, s in summary.items():
        n = f"{s['n']}" + (f" (+{s['failed']} failed)" if s["failed"] else "")
        rows.append(f"| {VARIANTS[v][0]} | {n} | {_cell(s, 'wall_s', 1)} | {_ratio(s, 'wall_s')} | "
                    f"{_cell(s, 'first_step_s', 1)} | {_ratio(s, 'first_step_s')} | "
                    f"{_cell(s, 'steady_steps_per_s', 1)} | {_ratio(s, 'steady_steps_per_s')} | "
                    f"{_cell(s, 'step_cpu_ms', 1)} | {_cell(s, 'machinery_cores', 3)} | {_cell(s, 'steps_per_s', 1)} | "
                    f"{_cell(s, 'observed_steps_per_s', 1)} | "
                    f"{_cell(s, 'driver_rss_mib', 0)} | {_cell(s, 'driver_cpu_s', 1)} |")
    return head + "\n".join(rows) + "\n\nEach cell: median (min–max) over the repetitions; ×bare: ratio of medians."


def phases_md(runs: list[Run], variants: list[str]) -> str:
    """Seconds after the launcher's spawn at which each phase was reached (median, min–max), and the step from the
    previous phase: where each launcher's seconds go."""
    names = [n for n, _ in ph.PHASES]
    out = ["| launcher | " + " | ".join(n.replace("_", " ") for n in names) + " |", "|---|" + "---:|" * len(names)]
    for v in variants:
        got = [r.phases for r in runs if r.variant == v and r.ok and r.phases]
        cells = []
        for n in names:
            vals = [p[n] for p in got if p.get(n) is not None]
            cells.append(f"{statistics.median(vals):.2f} ({min(vals):.2f}–{max(vals):.2f})" if vals else "-")
        out.append(f"| {VARIANTS[v][0]} | " + " | ".join(cells) + " |")
    out += ["", "Seconds after the launcher was spawned (median, min–max over the repetitions) at which the last rank "
            "reached each phase: " + "; ".join(f"**{n.replace('_', ' ')}**: {d}" for n, d in ph.PHASES) + ". "
            "Recorded inside the ranks by benchmarks/probe/ (time.time(), one clock with the driver's)."]
    return "\n".join(out)


def targets_md(tg: list[dict]) -> str:
    out = ["| target | measured | result |", "|---|---:|---|"]
    for t in tg:
        op = "<=" if t["kind"] == "max" else ">="
        what = "wall time" if t["metric"] == "wall" else "steps/s (steady, in ranks)"
        res = "not run" if t["pass"] is None else ("PASS" if t["pass"] else "FAIL")
        meas = "-" if t["ratio"] is None else f"{t['ratio']:.3f}x"
        out.append(f"| {VARIANTS[t['variant']][0]}: {what} {op} {t['limit']:g}x bare torchrun | {meas} | {res} |")
    return "\n".join(out)


def machine_md(info: dict) -> str:
    lb = info.get("load_before")
    la = info.get("load_after")
    fmt = lambda x: "-" if not x else " / ".join(f"{v:.2f}" for v in x)  # noqa: E731
    return "\n".join([
        f"- CPU: {info.get('cpus')} cores ({info.get('cpu', '?')}); memory {info.get('mem_total_gib', '?')} GiB "
        f"({info.get('mem_available_gib', '?')} GiB available at start); {info.get('platform', '?')}",
        f"- load average (1/5/15 min) before: {fmt(lb)}; after: {fmt(la)} (other jobs share this machine); "
        f"cores kept busy by others in the second before each run: {info.get('busy', '-')}",
        f"- Python {info.get('python')}, torch {info.get('torch')}, transformers {info.get('transformers')}, "
        f"trl {info.get('trl')}, accelerate {info.get('accelerate')}, datasets {info.get('datasets')}, "
        f"ray {info.get('ray')}, dualrun {info.get('dualrun')} (git {info.get('git', '?')})",
        f"- job: examples/sft.py, tiny model (examples/make_tiny_model.py), {info.get('nproc')} processes, gloo, "
        f"{info.get('steps')} steps, logging every step, no checkpoints; {info.get('reps')} repetitions, "
        f"session {info.get('session_s', '?')} s; running cluster start-ups: {info.get('cluster_start_s', '-')} s, "
        f"cores the idle cluster's own processes keep busy (5 s after start-up): {info.get('cluster_idle_cores', '-')}",
    ])


def runs_md(runs: list[Run]) -> str:
    out = ["| rep | launcher | ok | wall s | first step s | steady steps/s | CPU ms/step | launcher cores | "
           "trainer steps/s | seen steps/s | RSS MiB | CPU s | load 1m | busy cores before | threads in the ranks | "
           "train_loss |", "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in sorted(runs, key=lambda r: (r.rep, list(VARIANTS).index(r.variant))):
        ok = "yes" if r.ok else f"no: {r.error}"
        out.append(f"| {r.rep + 1} | {r.variant} | {ok} | {_f(r.wall_s)} | {_f(r.first_step_s)} | "
                   f"{_f(r.steady_steps_per_s)} | {_f(r.step_cpu_ms)} | {_f(r.machinery_cores, 3)}"
                   f"{_split(r.machinery_split)} | "
                   f"{_f(r.steps_per_s)} | {_f(r.observed_steps_per_s)} | {_f(r.driver_rss_mib, 0)} | "
                   f"{_f(r.driver_cpu_s)} | {_f(r.load_1m)} | {_f(r.busy_before)} | {r.threads or '-'} | "
                   f"{r.train_loss or '-'} |")
    return "\n".join(out)


def chart(summary: dict[str, dict], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("launch_bench: matplotlib is not installed (pip install matplotlib): no chart", file=sys.stderr)
        return False
    names = [v for v in summary if summary[v].get("wall_s")]
    labels = [SHORT[v] for v in names]
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.2))
    x = range(len(names))
    colors = ["#7f7f7f", "#1f77b4", "#ff7f0e", "#2ca02c", "#98df8a"][: len(names)]

    def bars(ax, metric, ylabel, ratio=True):
        med = [summary[v][metric]["median"] if summary[v].get(metric) else 0 for v in names]
        lo = [m - (summary[v][metric]["min"] if summary[v].get(metric) else 0) for v, m in zip(names, med)]
        hi = [(summary[v][metric]["max"] if summary[v].get(metric) else 0) - m for v, m in zip(names, med)]
        ax.bar(x, med, yerr=[lo, hi], capsize=4, color=colors)
        if ratio:
            for i, v in enumerate(names):
                r = summary[v]["ratio"].get(metric)
                if r is not None:
                    ax.text(i, med[i] + hi[i], f"{r:.2f}x", ha="center", va="bottom", fontsize=9)
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, fontsize=8.5)
        ax.set_ylabel(ylabel)
        return med

    bars(axes[0], "wall_s", "seconds")
    first = [summary[v]["first_step_s"]["median"] if summary[v].get("first_step_s") else 0 for v in names]
    axes[0].scatter(list(x), first, marker="_", s=900, color="black", zorder=3, label="first training step")
    axes[0].legend(fontsize=8, loc="upper left")
    axes[0].set_title("wall time (median, min–max) and time to first step")
    bars(axes[1], "steady_steps_per_s", "steps / s")
    axes[1].set_title("steady-state steps/s (inside the ranks)")
    bars(axes[2], "driver_rss_mib", "MiB")
    axes[2].set_title("peak RSS of the launcher process")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_launch(runs: list[Run], info: dict, variants: list[str], out_dir: Path, command_line: str,
                 readme: Path | None, fake: bool, main_readme: Path | None = None) -> str:
    """results/launch.md and the chart; the table blocks of `readme` (benchmarks/README.md) and `main_readme`."""
    summary = summarize(runs, variants)
    tg = targets(summary)
    title = (f"launch benchmark: tiny SFT, {info.get('nproc')} processes, {info.get('steps')} steps, "
             f"{info.get('reps')} reps, {info.get('cpus')} CPUs" + (" — FAKE NUMBERS" if fake else ""))
    has_chart = chart(summary, out_dir / "launch.png", title)
    body = table(summary)
    md = [f"# Launch benchmark{' (FAKE NUMBERS, test output)' if fake else ''}", "",
          f"Command: `{command_line}` — written {time.strftime('%Y-%m-%d %H:%M')}", "", body, "",
          "## Targets", "", targets_md(tg), "", "## Wall time by phase", "", phases_md(runs, variants), "",
          "## Machine", "", machine_md(info), ""]
    if has_chart:
        md += ["![launch benchmark](launch.png)", ""]
    md += ["## Every run (in the order they ran within a repetition, see benchmarks/README.md)", "", runs_md(runs), ""]
    (out_dir / "launch.md").write_text("\n".join(md))
    if readme is not None or main_readme is not None:
        lb_ = info.get("load_before") or ()
        _refresh(readme, f"{body}\n\n{targets_md(tg)}\n\n{phases_md(runs, variants)}\n\n{machine_md(info)}")
        _refresh(main_readme, (
            f"Latest `{command_line}` (tiny SFT, {info.get('nproc')} CPU processes, {info.get('steps')} steps, "
            f"{info.get('cpus')}-core machine shared with other jobs: load average {' / '.join(f'{x:.1f}' for x in lb_)} "
            f"before the run; median (min–max) of {info.get('reps')} interleaved repetitions; ratios against bare "
            "torchrun; phases, every run and the machine in [benchmarks/results/launch.md]"
            "(benchmarks/results/launch.md), how to rerun and how noisy this machine is in "
            f"[benchmarks/README.md](benchmarks/README.md)){_noise_note(info)}:\n\n{body}\n\nTargets (issue 14):\n\n"
            f"{targets_md(tg)}"))
    return body + "\n\n" + targets_md(tg)


def _noise_note(info: dict) -> str:
    """A warning when other jobs kept more processes runnable than there are cores: the ratios are then noise."""
    load = (info.get("load_before") or (0.0,))[0]
    if load > (info.get("cpus") or 1):
        return (f". **The load average ({load:.0f}) exceeded the {info.get('cpus')} cores: every ratio and PASS/FAIL "
                "below is within the noise; only the CPU columns (CPU ms per step, launcher CPU while training) are "
                "meaningful. Rerun on a quiet machine.**")
    return ""


def _refresh(path: Path | None, block: str) -> None:
    """Replace what lies between the launch-table markers of `path` (nothing when it has none)."""
    if path is None or not path.exists():
        return
    text = path.read_text()
    if README_START in text and README_END in text:
        pre, rest = text.split(README_START, 1)
        path.write_text(f"{pre}{README_START}\n{block}\n{README_END}{rest.split(README_END, 1)[1]}")


# -- planner -----------------------------------------------------------------------------------------------------

def bench_planner(reps: int) -> str:
    from dualrun.config import build_config
    from dualrun.plan import Cluster, make_plan

    cases = [
        ("sft, ray, 1,024 GPUs on 128 nodes x 8", {"backend": "ray", "roles": {"train": {"gpus": 1024}}},
         Cluster.uniform(128, 8)),
        ("gkd, ray, train 1,008 + rollout 8 + teacher 8 on 128 x 8",
         {"backend": "ray", "method": "gkd", "roles": {"train": {"gpus": 1008}, "rollout": {"gpus": 8},
                                                       "teacher": {"gpus": 8}}}, Cluster.uniform(128, 8)),
        ("sft, torchrun, num_machines 128, 1,024 GPUs (assumed cluster)",
         {"backend": "torchrun", "num_machines": 128, "roles": {"train": {"gpus": 1024}}}, None),
    ]
    rows = ["| plan | processes | config s | make_plan s | to_json s | make_plan + to_json s (min) | JSON KiB |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for name, raw, cluster in cases:
        tc, tp, tj, both = [], [], [], []
        for _ in range(reps):
            t = time.perf_counter()
            cfg = build_config(raw, "planner-bench.yaml")
            t1 = time.perf_counter()
            plan = make_plan(cfg, cluster)
            t2 = time.perf_counter()
            text = plan.to_json()
            t3 = time.perf_counter()
            tc.append(t1 - t)
            tp.append(t2 - t1)
            tj.append(t3 - t2)
            both.append(t3 - t1)
        med = statistics.median
        rows.append(f"| {name} | {len(plan.processes)} | {med(tc):.4f} | {med(tp):.4f} | {med(tj):.4f} | "
                    f"{med(both):.4f} ({min(both):.4f}) | {len(text) / 1024:.0f} |")
    return "\n".join(rows) + f"\n\nMedian of {reps} runs each (pure Python: no Ray, no torch)."


def write_planner(out_dir: Path, reps: int, info: dict) -> str:
    body = bench_planner(reps)
    (out_dir / "planner.md").write_text(
        "# Planner benchmark: 1,024 GPUs on 128 nodes\n\n"
        "`dualrun.plan.make_plan` + `Plan.to_json` (what `dualrun plan --json` prints), timed in-process.\n\n"
        f"{body}\n\nMachine: {info.get('cpus')} CPUs ({info.get('cpu', '?')}), Python {info.get('python')}, "
        f"load average before {', '.join(f'{x:.2f}' for x in info.get('load_before', ()))}. "
        f"Written {time.strftime('%Y-%m-%d %H:%M')} by `python benchmarks/launch_bench.py`.\n")
    return body


# -- fake numbers (tests) ----------------------------------------------------------------------------------------

def fake_runs(variants: list[str], reps: int) -> list[Run]:
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
    p.add_argument("--reps", type=int, default=5, help="repetitions of every variant (round-robin)")
    p.add_argument("--steps", type=int, default=200, help="training steps per run (max_steps)")
    p.add_argument("--nproc", type=int, default=2, help="training processes per run")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {', '.join(VARIANTS)}")
    p.add_argument("--out-dir", default=str(RESULTS), help="where launch.md, launch.png, planner.md go")
    p.add_argument("--readme", default=None,
                   help="README whose table block to refresh (default: benchmarks/README.md with the default "
                   "--out-dir)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before one run is killed")
    p.add_argument("--cluster-cpus", type=int, default=4, help="CPUs of the running cluster")
    p.add_argument("--settle", type=float, default=3.0, help="seconds to wait after starting the running cluster")
    p.add_argument("--quiet-cores", type=float, default=0.3,
                   help="before each run, wait until other jobs keep fewer than this many cores busy ...")
    p.add_argument("--quiet-wait", type=float, default=0.0,
                   help="... for at most this many seconds (default 0: only measure and report it)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the untimed warm-up run")
    p.add_argument("--planner-reps", type=int, default=20)
    p.add_argument("--no-planner", dest="planner", action="store_false")
    p.add_argument("--keep-logs", default=None, metavar="DIR", help="keep every run's timestamped output here")
    p.add_argument("--fake", action="store_true", help="synthetic launch numbers: write the outputs, start nothing")
    p.add_argument("--quick", action="store_true", help="2 repetitions of 60 steps, planner 3 times (a smoke run: "
                   "the full run is --reps 5 --steps 200)")
    ns = p.parse_args(argv)
    if ns.quick:
        ns.reps, ns.steps, ns.planner_reps = 2, 60, 3
    ns.variants = [v.strip() for v in ns.variants.split(",") if v.strip()]
    unknown = [v for v in ns.variants if v not in VARIANTS]
    if unknown or not ns.variants:
        p.error(f"unknown variant(s) {unknown}: choose from {', '.join(VARIANTS)}")
    ns.variants = [v for v in VARIANTS if v in ns.variants]
    out_dir = Path(ns.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    readme = Path(ns.readme) if ns.readme else (HERE / "README.md" if out_dir == RESULTS.resolve() else None)
    command_line = "python benchmarks/launch_bench.py " + " ".join(argv)

    if ns.fake:
        info = machine()
        info.update(load_before=loadavg(), load_after=loadavg(), steps=ns.steps, reps=ns.reps, nproc=ns.nproc,
                    busy="median 0.10 (fake)")
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
