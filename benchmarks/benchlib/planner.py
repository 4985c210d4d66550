"""The planner at scale: `make_plan` + `Plan.to_json` (what `dualrun plan --json` prints) for 1,024 GPUs on 128
nodes, timed in-process. Pure Python, no Ray, no torch: the plan must stay instant however large the job."""
from __future__ import annotations

import statistics
import time
from pathlib import Path


def bench_planner(reps: int) -> str:
    """A Markdown table: the median of `reps` timings of each case (SFT and GKD on Ray, SFT on torchrun)."""
    from dualrun.config import build_config
    from dualrun.plan.processes import Cluster, make_plan

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
    """results/planner.md: the table, and the machine it was timed on (`info`: noise.machine() and load_before)."""
    body = bench_planner(reps)
    (out_dir / "planner.md").write_text(
        "# Planner benchmark: 1,024 GPUs on 128 nodes\n\n"
        "`dualrun.plan.processes.make_plan` + `Plan.to_json` (what `dualrun plan --json` prints), timed in-process.\n\n"
        f"{body}\n\nMachine: {info.get('cpus')} CPUs ({info.get('cpu', '?')}), Python {info.get('python')}, "
        f"load average before {', '.join(f'{x:.2f}' for x in info.get('load_before', ()))}. "
        f"Written {time.strftime('%Y-%m-%d %H:%M')} by `python benchmarks/launch_bench.py`.\n")
    return body

