"""Slice vs broadcast dispatch on a real (local, fake-GPU) Ray cluster: time per call and bytes per worker.

    unshare -n bash -c 'ip link set lo up; python benchmarks/dispatch_bench.py --workers 4 --mb 16 64'

Writes a Markdown table to benchmarks/results/dispatch.md (and prints it). Bytes are what each worker pulled
from the object store (the size of the object it resolved), summed over the timed calls and divided by them.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time

import dualrun


class Sink:
    def take(self, batch: list) -> int:
        return sum(len(b) for b in batch)


def bench(group: dualrun.WorkerGroup, batch: list, dispatch: str, repeat: int) -> tuple[float, float]:
    before = [s["bytes_in"] for s in group.stats()]
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        group.run("take", batch, dispatch=dispatch)
        times.append(time.perf_counter() - t)
    after = [s["bytes_in"] for s in group.stats()]
    per_worker = statistics.mean(a - b for a, b in zip(after, before)) / repeat
    return statistics.median(times), per_worker


def main() -> None:
    import ray

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--mb", type=int, nargs="+", default=[16, 64], help="batch sizes in MiB")
    p.add_argument("--items", type=int, default=256, help="items per batch")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "dispatch.md"))
    args = p.parse_args()

    ray.init(address="local", num_gpus=args.workers, num_cpus=args.workers, include_dashboard=False,
             _temp_dir=tempfile.mkdtemp(prefix="drb", dir="/tmp"), log_to_driver=False,
             object_store_memory=max(512, 6 * max(args.mb)) * 1024 * 1024)
    dualrun.init({"roles": {"w": {"gpus": args.workers}}}, backend="ray", track_bytes=True)
    group = dualrun.WorkerGroup(Sink, "w")
    rows = []
    for mb in args.mb:
        size = mb * 1024 * 1024 // args.items
        batch = [bytes(size) for _ in range(args.items)]  # distinct objects (pickle would share one)
        total = size * args.items
        group.run("take", batch[:1])  # warm up
        for mode in ("slice", "all"):
            t, per = bench(group, batch, mode, args.repeat)
            rows.append((mb, "slice" if mode == "slice" else "broadcast", t, per, per / total))
    dualrun.shutdown()
    ray.shutdown()
    lines = [f"# Dispatch benchmark: slice vs broadcast ({args.workers} workers, local Ray, "
             f"{os.cpu_count()} CPUs, {platform.machine()})", "",
             "| batch (MiB) | dispatch | median time per call (s) | MiB received per worker | share of batch |",
             "|---:|---|---:|---:|---:|"]
    lines += [f"| {mb} | {mode} | {t:.3f} | {per / 2**20:.2f} | {frac:.3f} |" for mb, mode, t, per, frac in rows]
    lines += ["", f"Expected share: slice 1/{args.workers} = {1 / args.workers:.3f}, broadcast 1.000.",
              f"Command: `python benchmarks/dispatch_bench.py --workers {args.workers} --mb "
              f"{' '.join(map(str, args.mb))}`"]
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
