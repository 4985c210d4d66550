"""Profile the driver of `dualrun launch` (the launcher process only) on the tiny SFT: imports and cProfile.

    python benchmarks/profile_driver.py --out /tmp/dualrun-profile [--backends torchrun,ray,ray-embedded]

For each backend it runs the launch twice: once under `python -X importtime` (driver imports; workers are not
affected) and once under `python -m cProfile` (main thread of the driver). It prints the slowest imports, the top
functions by cumulative time, and the timestamps of dualrun's own phases seen on its output. The Ray "running
cluster" is started and stopped by this script (benchlib.cluster, as in launch_bench.py). Loopback only, like launch_bench.py.
"""
from __future__ import annotations

import argparse
import io
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchlib import REPO
from benchlib.cluster import RunningCluster
from benchlib.job import command, script_args
from benchlib.sandbox import ensure_loopback_only


def top_imports(stderr: str, n: int) -> list[tuple[int, int, str]]:
    """(cumulative us, self us, module) of the slowest top-level-ish imports in `-X importtime` output."""
    rows = []
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line or "cumulative" in line:
            continue
        self_us, cum_us, name = line[len("import time:"):].split("|", 2)
        depth = (len(name) - len(name.lstrip())) // 2
        if depth <= 1:
            rows.append((int(cum_us), int(self_us), name.strip()))
    return sorted(rows, reverse=True)[:n]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="folder for the raw outputs (importtime text, .prof files)")
    p.add_argument("--backends", default="torchrun,ray,ray-embedded")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=25)
    ns = p.parse_args()
    ensure_loopback_only(sys.argv[1:])
    out = Path(ns.out or tempfile.mkdtemp(prefix="lbprof"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="lbp", dir="/tmp"))
    tiny = work / "tiny"
    subprocess.run([sys.executable, str(REPO / "examples" / "make_tiny_model.py"), "--out", str(tiny)], check=True,
                   capture_output=True)
    env0 = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "DUALRUN_BENCH_UNSHARED")}
    env0.update(ACCELERATE_USE_CPU="true", PYTHONUNBUFFERED="1")
    cluster = RunningCluster()
    try:
        for backend in ns.backends.split(","):
            env = dict(env0)
            if backend == "ray":
                if cluster.cluster is None:
                    cluster.start()
                env["RAY_ADDRESS"] = cluster.address
            else:
                cluster.stop()
                if backend == "ray-embedded":
                    env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="lbe", dir="/tmp")
            variant = {"torchrun": "dualrun-torchrun", "ray": "dualrun-ray", "ray-embedded": "dualrun-ray-embedded"}
            cmd = command(variant[backend], script_args(tiny, work / f"o-{backend}", ns.steps), 2)
            py, rest = cmd[0], cmd[1:]
            it = subprocess.run([py, "-X", "importtime", *rest], env=env, cwd=REPO, capture_output=True, text=True)
            (out / f"importtime-{backend}.txt").write_text(it.stderr)
            prof = out / f"cprofile-{backend}.prof"
            cp = subprocess.run([py, "-m", "cProfile", "-o", str(prof), *rest], env=env, cwd=REPO,
                                capture_output=True, text=True)
            print(f"\n=== dualrun --backend {backend}: exit codes importtime {it.returncode}, cProfile {cp.returncode}")
            total = sum(int(line.split("|")[1]) for line in it.stderr.splitlines()
                        if line.startswith("import time:") and "|" in line and "self" not in line)
            print(f"driver imports: {total / 1e6:.2f} s in total (self time summed); slowest top-level imports:")
            for cum, _, name in top_imports(it.stderr, 12):
                print(f"  {cum / 1e6:7.3f} s  {name}")
            s = io.StringIO()
            pstats.Stats(str(prof), stream=s).sort_stats("cumulative").print_stats(ns.top)
            print("\n".join(ln for ln in s.getvalue().splitlines() if ln.strip())[:8000])
            if "RAY_TMPDIR" in env:
                shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
    finally:
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nraw outputs in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
