"""Generation throughput of CPU-engine replicas behind the router: 1 engine straight, 1 and 2 behind the router.

    unshare -n bash -c 'ip link set lo up; python benchmarks/replica_throughput.py'      # about 2-4 min on 2 cores

A generation-bound load as TRL's client sends it: many single-prompt greedy /v1/completions requests in flight at
once (`--concurrency`), each asking `--max-tokens` new tokens of the tiny model from examples/make_tiny_model.py.
Every engine is dualrun's CPU engine with one torch thread (as dualrun starts it), so 2 replicas can use 2 cores.
The three layouts take turns, `--rounds` times, so load from other jobs on a shared machine hits them alike;
tokens/s is completion tokens over wall time, the median round reported. Also checks that the completions through
the router equal one engine's (greedy) and that both replicas served requests. Writes results/replicas.md.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from benchlib.servers import start_cpu_engines, start_router  # noqa: E402

OUT = os.path.join(ROOT, "benchmarks", "results", "replicas.md")
TARGET = 1.6  # 2 replicas over 1 engine


def _load(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> tuple[float, int, list]:
    import requests

    session = requests.Session()
    session.trust_env = False

    def one(prompt: list[int]) -> list[int]:
        r = session.post(f"{url}/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": max_tokens,
                                                         "temperature": 0}, timeout=600)
        r.raise_for_status()
        return r.json()["choices"][0]["token_ids"]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        outs = list(pool.map(one, prompts))
    wall = time.perf_counter() - t0
    return wall, sum(map(len, outs)), outs


def _served(server) -> int:
    import requests

    from dualrun.programs.cpu_engine import STATS_PATH

    return requests.get(f"http://{server.address}{STATS_PATH}", timeout=10,
                        proxies={"http": None}).json()["completions"]


def measure(model: str, requests_n: int, max_tokens: int, concurrency: int, rounds: int) -> dict:
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(5, 60) for _ in range(rng.randrange(4, 12))] for _ in range(requests_n)]
    stack: list = []
    try:
        engines = start_cpu_engines(model, 2, stack)
        layouts = {"1 engine, direct": f"http://{engines[0].address}",
                   "1 engine behind the router": f"http://{start_router(engines[:1], stack, 60).address}",
                   "2 replicas behind the router": f"http://{start_router(engines, stack, 60).address}"}
        _load(layouts["1 engine, direct"], prompts[:4], max_tokens, 2)  # warm-up (first-call costs)
        runs: dict[str, list[dict]] = {name: [] for name in layouts}
        reference = None
        served = [0] * len(engines)    # requests each replica served in the 2-replica layout's rounds
        loads = []
        for _ in range(rounds):
            for name, url in layouts.items():
                loads.append(os.getloadavg()[0])
                before = [_served(e) for e in engines]
                wall, tokens, outs = _load(url, prompts, max_tokens, concurrency)
                if name.startswith("2 replicas"):
                    served = [n + _served(e) - b for n, e, b in zip(served, engines, before)]
                reference = reference or outs
                runs[name].append({"wall": wall, "tokens": tokens, "same": outs == reference})
        return {"runs": runs, "served": served, "loads": loads}
    finally:
        for s in reversed(stack):
            s.stop(grace_s=2)


def report(res: dict, args: argparse.Namespace) -> str:
    med = {name: statistics.median(r["tokens"] / r["wall"] for r in runs) for name, runs in res["runs"].items()}
    one = med["1 engine, direct"]
    two = med["2 replicas behind the router"]
    speedup = two / one
    lines = ["# Generation throughput: CPU-engine replicas behind the router", "",
             f"{args.requests} single-prompt greedy /v1/completions requests of {args.max_tokens} new tokens each, "
             f"{args.concurrency} in flight (as TRL's client sends them), tiny model of examples/make_tiny_model.py, "
             f"each engine one torch thread; the layouts take turns, {args.rounds} rounds, median round. "
             f"`python benchmarks/replica_throughput.py` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}).", "",
             "| layout | tokens/s (median) | rounds (tokens/s) | completions equal one engine's |",
             "|---|---:|---|---|"]
    for name, runs in res["runs"].items():
        each = ", ".join(f"{r['tokens'] / r['wall']:.0f}" for r in runs)
        lines.append(f"| {name} | {med[name]:.0f} | {each} | {'yes' if all(r['same'] for r in runs) else 'NO'} |")
    load = os.getloadavg()
    lines += ["",
              f"- **2 replicas / 1 engine: {speedup:.2f}x** (target >= {TARGET:g}x on 2 cores: "
              f"{'PASS' if speedup >= TARGET else 'FAIL'}); 1 engine behind the router makes "
              f"{med['1 engine behind the router'] / one * 100:.0f} % of its direct tokens/s (the router's hop is "
              "~1 ms a request, see router.md; round-to-round noise here is larger).",
              f"- Requests each replica served in the 2-replica rounds: {res['served']} (the router spreads them; "
              "no request is split: each carries one prompt).",
              f"- Machine: {platform.platform()}, {os.cpu_count()} cores, shared with other jobs: load average at the "
              f"start of each run {', '.join(f'{x:.1f}' for x in res['loads'])}; now {load[0]:.1f} / {load[1]:.1f} / "
              f"{load[2]:.1f} (1/5/15 min). On a loaded machine each process gets a share of the cores, so rounds "
              "vary and 2 replica processes get up to two shares: the ratio there says the replicas work in parallel, "
              f"not that 2 idle cores were free; Python {platform.python_version()}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default=None, help="a causal LM dir (default: the tiny model, built in a temp dir)")
    p.add_argument("--out", default=OUT)
    args = p.parse_args(argv)
    model = args.model
    if model is None:
        tmp = tempfile.mkdtemp(prefix="dualrun-bench-")
        subprocess.run([sys.executable, os.path.join(ROOT, "examples", "make_tiny_model.py"), "--out", tmp],
                       check=True, capture_output=True)
        model = os.path.join(tmp, "model")
    text = report(measure(model, args.requests, args.max_tokens, args.concurrency, args.rounds), args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        print(text, file=f, end="")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
