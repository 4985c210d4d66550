"""A dead or hung teacher replica replaced while the trainer's client goes on: how fast, and what the client sees.

    unshare -n bash -c 'ip link set lo up; python benchmarks/replica_restart_bench.py'   # ~3-6 min on 2 cores
    python benchmarks/replica_restart_bench.py --backend ray   # the same through RayServers on an embedded cluster

The real restart path (`roles.teacher.replica_restarts`): a GKD teacher of 2 CPU-engine replicas behind dualrun's
router, started, watched and restarted by the backend's own server set (`LocalServers` for torchrun, `RayServers`
for Ray: a fresh actor and placement group), the tiny teacher of examples/make_tiny_model.py. Meanwhile a
stand-in trainer takes steps without pause: each step is one scoring call of 4 sequences through TRL's client
(`get_sequence_logprobs`, the call dualrun's RemoteTeacher makes every GKD step) and must answer exactly what the
first step answered (the teacher is greedy and deterministic). Each round, replica `round % 2` is SIGKILLed (dead)
or SIGSTOPped (hung; `request_timeout_s` 5) and the router's table is read every 5 ms:

- kill -> out of rotation: until the router no longer routes to it (target <= 1 s for a dead one; a hung one is
  found by its health probe: ~1 s interval, 5 s to answer),
- kill -> back in rotation: until the restarted replica (fresh port) is in rotation again, next to the start time of
  a bare engine measured in the same round (start_cpu_engines: spawn to healthy, same command),
- steps lost (a step that raised or answered differently; target 0) and requests failed as the client saw them.

Writes results/replica_restart.md (machine, load, every round, median and spread, the command line).
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from benchlib.noise import busy_cores, loadavg, machine  # noqa: E402
from benchlib.sandbox import ensure_loopback_only  # noqa: E402
from benchlib.servers import start_cpu_engines  # noqa: E402

OUT = os.path.join(ROOT, "benchmarks", "results", "replica_restart.md")
POLL_S = 0.005
HUNG_TIMEOUT_S = 5   # request_timeout_s of the role: how long a hung replica may stay out before it is stopped


def _server_set(backend: str, tiny: str, log_dir: str, restarts: int):
    """The backend's server set for a GKD teacher of 2 replicas (and its cleanup), as `dualrun launch` makes it."""
    from dualrun.config import build_config
    from dualrun.plan.processes import make_plan
    from dualrun.methods.plugin import get_plugin

    cfg = build_config({"backend": backend, "method": "gkd", "use_cpu": True, "log_dir": log_dir, "roles": {
        "train": {"gpus": 1}, "teacher": {"gpus": 2, "model": os.path.join(tiny, "teacher"), "top_k": 5,
                                          "health_timeout_s": 120, "request_timeout_s": HUNG_TIMEOUT_S,
                                          "replica_restarts": restarts}}}, "bench.yaml")
    plugin = get_plugin("gkd")
    plugin.validate(cfg)
    if backend == "torchrun":
        from dualrun.servers.local import LocalServers
        from dualrun.plan.server_commands import with_method

        return LocalServers(with_method(make_plan(cfg, method=plugin), cfg, plugin),
                            lambda p: dict(os.environ, **p.env),
                            stream=None), lambda: None
    import ray

    from dualrun.backends.ray import cluster as rc
    from dualrun.launchers.launcher import Program
    from dualrun.backends.ray.actor_launcher import RayLauncher

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    launcher = RayLauncher(cfg, Program("bench.py"), {}, plugin=plugin)
    plan = launcher.prepare(make_plan(cfg, rc.cluster_of(rc.alive_nodes()), method=plugin)).plan
    return launcher.server_set(plan, 0, frozenset()), ray.shutdown


class Trainer:
    """The stand-in trainer: scoring steps through the router, back to back, on a thread of its own."""

    def __init__(self, address: str) -> None:
        from dualrun.rank.teacher import teacher_client

        self.client = teacher_client(f"http://{address}")
        self.sequences = [[5 + (7 * i + j) % 50 for j in range(12 + i)] for i in range(4)]
        self.reference = self._step()
        self.steps = self.lost = self.failed = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _step(self) -> dict:
        return self.client.get_sequence_logprobs(sequences=self.sequences, prompt_lengths=[1] * 4, top_logprobs=5,
                                                 temperature=1.0)

    def _run(self) -> None:
        while not self.done.is_set():
            try:
                ok = self._step() == self.reference
            except Exception:  # noqa: BLE001 - what the trainer would see
                ok = False
                self.failed += 1
            self.steps += 1
            self.lost += not ok


def _pid(log: str) -> int:
    import re

    with open(log) as f:
        return int(re.findall(r"dualrun engine: loading .* \(pid (\d+)\)", f.read())[-1])


def _until(check, limit: float) -> float | None:
    """Seconds until `check()` is true (polled every POLL_S), None after `limit`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if check():
            return time.monotonic() - t0
        time.sleep(POLL_S)
    return None


def one_round(servers, router: str, replica: int, mode: str, tiny: str, log_dir: str, trainer: Trainer) -> dict:
    from dualrun.servers import router_client

    def table() -> dict:
        return router_client.replicas(router, timeout_s=5.0)

    _until(lambda: table()["in_rotation"] == [0, 1], 120)
    old = table()["replicas"][replica]["address"]
    pid = _pid(os.path.join(log_dir, f"teacher-server-{replica}.log"))
    steps, lost, failed = trainer.steps, trainer.lost, trainer.failed
    load = loadavg()[0]
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
    out = _until(lambda: replica not in table()["in_rotation"], 60)
    back = _until(lambda: replica in table()["in_rotation"] and table()["replicas"][replica]["address"] != old, 300)
    back = None if back is None else time.monotonic() - killed
    if mode == "stop":
        try:
            os.kill(pid, signal.SIGCONT)   # stopped by the set with SIGKILL: already gone
        except ProcessLookupError:
            pass
    stack: list = []
    t0 = time.monotonic()
    try:
        start_cpu_engines(os.path.join(tiny, "teacher"), 1, stack)   # a bare engine's start, under the same load
        engine = time.monotonic() - t0
    finally:
        for s in stack:
            s.stop(grace_s=2)
    return {"replica": replica, "mode": mode, "out": out, "back": back, "engine": engine, "load": load,
            "steps": trainer.steps - steps, "lost": trainer.lost - lost, "failed": trainer.failed - failed,
            "failure": str(servers.failure).splitlines()[0] if servers.failure else ""}


def measure(backend: str, tiny: str, rounds: int, modes: list[str]) -> dict:
    log_dir = tempfile.mkdtemp(prefix="dualrun-restart-bench-")
    servers, cleanup = _server_set(backend, tiny, log_dir, rounds * len(modes))
    results = []
    try:
        router = servers.start()["teacher"]
        servers.watch()
        trainer = Trainer(router)
        trainer.thread.start()
        for r in range(rounds):
            for mode in modes:
                results.append(one_round(servers, router, r % 2, mode, tiny, log_dir, trainer))
                print(results[-1], flush=True)
        trainer.done.set()
        trainer.thread.join(timeout=30)
        return {"rounds": results, "steps": trainer.steps, "lost": trainer.lost, "failed": trainer.failed}
    finally:
        servers.stop(grace_s=3)
        cleanup()


def _spread(xs: list) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    return f"{statistics.median(xs):.2f} s ({min(xs):.2f}-{max(xs):.2f})"


def report(res: dict, args: argparse.Namespace, info: dict, command: str) -> str:
    lines = [f"# A replica replaced while the trainer goes on ({args.backend})", "",
             f"`{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}). GKD teacher of 2 CPU-engine "
             "replicas behind dualrun's router, restarted by the backend's own server set; a stand-in trainer "
             "scores 4 sequences per step through TRL's client without pause. Times from the signal; the router's "
             "table read every 5 ms.", "",
             "| mode | signal -> out of rotation, median (min-max) | signal -> back in rotation | a bare engine's start "
             "(same round) | steps during | steps lost | requests failed |", "|---|---:|---:|---:|---:|---:|---:|"]
    for mode in args.modes:
        rows = [r for r in res["rounds"] if r["mode"] == mode]
        name = {"kill": "SIGKILL (dead)", "stop": f"SIGSTOP (hung, request_timeout_s {HUNG_TIMEOUT_S})"}[mode]
        lines.append(f"| {name} | {_spread([r['out'] for r in rows])} | {_spread([r['back'] for r in rows])} | "
                     f"{_spread([r['engine'] for r in rows])} | {sum(r['steps'] for r in rows)} | "
                     f"{sum(r['lost'] for r in rows)} | {sum(r['failed'] for r in rows)} |")
    lines += ["", "Every round:", "", "| # | replica | mode | out s | back s | engine start s | load 1 min | steps | "
              "lost | failed | the set's failure |", "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    for i, r in enumerate(res["rounds"]):
        lines.append(f"| {i} | {r['replica']} | {r['mode']} | {fmt(r['out'])} | {fmt(r['back'])} | "
                     f"{fmt(r['engine'])} | {r['load']:.1f} | {r['steps']} | {r['lost']} | {r['failed']} | "
                     f"{r['failure'] or '-'} |")
    la = loadavg()
    out_kill = [r["out"] for r in res["rounds"] if r["mode"] == "kill" and r["out"] is not None]
    lines += ["",
              f"- Whole run: {res['steps']} steps, **{res['lost']} lost**, **{res['failed']} requests failed** as the "
              f"client saw them (target 0 and 0); dead -> out of rotation at most "
              f"{max(out_kill) if out_kill else float('nan'):.2f} s (target <= 1 s: "
              f"{'PASS' if out_kill and max(out_kill) <= 1.0 else 'FAIL'}).",
              "- Back in rotation = the engine's start plus the set's own work (the watcher's poll, the restart "
              "line, on Ray a fresh placement group and actor) plus up to one router probe (~1 s); a hung one first "
              f"waits out request_timeout_s ({HUNG_TIMEOUT_S} s) and its stop.",
              f"- Machine: {info.get('cpus')} cores ({info.get('cpu', '?')}), {info.get('mem_total_gib', '?')} GiB, "
              f"{info.get('platform')}; shared with other jobs: load average before {info['load_before']}, after "
              f"{la[0]:.1f} / {la[1]:.1f} / {la[2]:.1f} (1/5/15 min), cores busy before the run "
              f"{info['busy']:.1f}; Python {info.get('python')}, torch {info.get('torch')}, transformers "
              f"{info.get('transformers')}, trl {info.get('trl')}, ray {info.get('ray')} (git {info.get('git', '?')})."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["torchrun", "ray"], default="torchrun")
    p.add_argument("--rounds", type=int, default=3, help="rounds; each kills (and stops) one replica once")
    p.add_argument("--modes", default="kill,stop", help="kill (SIGKILL: dead), stop (SIGSTOP: hung), or both")
    p.add_argument("--tiny", default=None, help="examples/make_tiny_model.py's output (default: built in a temp dir)")
    p.add_argument("--out", default=None, help="default: results/replica_restart.md (--backend ray: _ray.md)")
    args = p.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    ensure_loopback_only(sys.argv[1:] if argv is None else argv)
    tiny = args.tiny
    if tiny is None:
        tiny = tempfile.mkdtemp(prefix="dualrun-bench-")
        subprocess.run([sys.executable, os.path.join(ROOT, "examples", "make_tiny_model.py"), "--out", tiny],
                       check=True, capture_output=True)
    info = machine()
    info["load_before"] = " / ".join(f"{x:.1f}" for x in loadavg())
    info["busy"] = busy_cores()
    command = "python benchmarks/replica_restart_bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
    res = measure(args.backend, tiny, args.rounds, args.modes)
    text = report(res, args, info, command.strip())
    out = args.out or (OUT if args.backend == "torchrun" else OUT.replace(".md", "_ray.md"))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        print(text, file=f, end="")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
