"""What vLLM's spinning shared-memory readers cost a CPU machine, against dualrun's quiet readers
(dualrun/servers/quiet_readers.py), measured in the same run.

    bash scripts/in-loopback.sh .venv-vllm/bin/python benchmarks/quiet_readers_bench.py   # ~4 min on 2 cores

Per mode (vLLM's readers as shipped: a second's spin after every message; dualrun's, as the plan marks every vLLM
CPU engine), one vLLM CPU server of weight_sync_bench's ~100M-parameter model, started as dualrun starts a rollout
(TRL's flags, the gloo weight transfer, vLLM's default layout: API server, engine core, worker), and in this process:

- generation: 4 completions of 64 tokens (`ignore_eos`), wall seconds per request;
- a trainer's step right after a short request: forward and backward three times of the same model here (2 torch
  threads, one sequence of 64 tokens), what a CPU GRPO step does after each generation and weight-sync call;
- the same step 1.5 s after a request (every spin over): the step's own time, the control;
- the server's process tree's CPU-seconds in the second after a request.

Medians with min-max over `--reps`. Writes results/quiet_readers.md (and `--json`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))
sys.path.insert(0, BENCH)

from benchlib.cpu import CpuMeter  # noqa: E402
from weight_sync_bench import build_models, start_servers, versions  # noqa: E402

OUT = os.path.join(BENCH, "results", "quiet_readers.md")
MODES = {"vLLM's readers (spin 1 s)": "0", "dualrun's quiet readers": "1"}


def measure(model_dir: str, marker: str, reps: int, log_dir: str) -> dict[str, list[float]]:
    import requests
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.set_num_threads(2)
    tokens = torch.randint(0, 15, (1, 64))

    def step() -> float:
        t0 = time.perf_counter()
        for _ in range(3):
            model(tokens).logits.sum().backward()
        return time.perf_counter() - t0

    stack: list = []
    try:
        server = start_servers(model_dir, 1, log_dir, stack, {"DUALRUN_VLLM_QUIET_READERS": marker})[0]
        url = f"http://{server.address}"
        name = requests.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]

        def complete(n: int, tokens_each: int) -> float:
            t0 = time.perf_counter()
            reply = requests.post(f"{url}/v1/completions", timeout=300, json={
                "model": name, "prompt": [2, 10, 11], "max_tokens": tokens_each, "n": n, "temperature": 1.0,
                "ignore_eos": True})
            reply.raise_for_status()
            return time.perf_counter() - t0

        meter = CpuMeter({"server": [server.proc.pid]})
        complete(4, 64), step()   # warm both
        out: dict[str, list[float]] = {"generate_s": [], "step_after_s": [], "step_rested_s": [], "server_cpu_s": []}
        for _ in range(reps):
            out["generate_s"].append(complete(4, 64))
            complete(1, 8)
            out["step_after_s"].append(step())
            complete(1, 8)
            meter.read()
            time.sleep(1.0)
            out["server_cpu_s"].append(meter.read()["server"])
            time.sleep(0.5)
            out["step_rested_s"].append(step())
        return out
    finally:
        for s in reversed(stack):
            s.stop(grace_s=5)


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def report(results: dict[str, dict[str, list[float]]], meta: dict) -> str:
    rows = [("generation, 4 x 64 tokens (s)", "generate_s"), ("trainer step right after a request (s)", "step_after_s"),
            ("trainer step 1.5 s after a request (s)", "step_rested_s"),
            ("server's CPU-seconds in the second after a request", "server_cpu_s")]
    modes = list(results)
    lines = ["# vLLM's spinning readers against dualrun's quiet readers (a vLLM CPU engine)", "",
             f"`{meta['command']}`, {meta['when']}, {meta['reps']} repetitions, load at the end {meta['load_end']}; "
             f"{meta['versions']}.", "",
             "Median (min-max). One ~100M-parameter vLLM CPU server in vLLM's default layout, the trainer's step in "
             "the benchmark's process (2 torch threads) on the same 2 cores.", "",
             "| | " + " | ".join(modes) + " |", "|---|" + "---:|" * len(modes)]
    for label, key in rows:
        lines.append(f"| {label} | " + " | ".join(summary(results[m][key]) for m in modes) + " |")
    a, b = (statistics.median(results[m]["step_after_s"]) for m in modes)
    g0, g1 = (statistics.median(results[m]["generate_s"]) for m in modes)
    lines += ["", f"A trainer step right after a request: {b / a:.2f} of its time with vLLM's readers; generation: "
              f"{g1 / g0:.2f} of its time.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--out", default=OUT)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="dualrun-quiet-") as work:
        model = build_models(work, ["100M"])["100M"]
        results = {mode: measure(model, marker, args.reps, work) for mode, marker in MODES.items()}
    load = os.getloadavg()
    meta = {"command": "bash scripts/in-loopback.sh .venv-vllm/bin/python benchmarks/quiet_readers_bench.py"
            + (f" --reps {args.reps}" if args.reps != 6 else ""),
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "reps": args.reps,
            "load_end": f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}", "versions": versions()}
    text = report(results, meta)
    with open(args.out, "w") as f:
        f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
