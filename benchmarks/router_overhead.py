"""Router overhead per request on loopback: the same requests straight to a replica and through the router.

    unshare -n bash -c 'ip link set lo up; python benchmarks/router_overhead.py'      # about 40 s

Two stub replicas (benchlib/stub.py: processes that answer at once, so that the time measured is transport) stand
behind `dualrun.programs.router` (a process). One client with a kept-alive connection alternates: a request straight
to replica 0, the same request through the router, the two kinds below interleaved. Two kinds: a single-prompt /v1/completions (goes to one replica
whole) and a two-prompt one (split over both replicas, answers merged). Added latency = router percentile minus
direct percentile. The router's resident memory is read before and after the timed requests. Writes
results/router.md.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchlib.load import pct as _pct  # noqa: E402
from benchlib.servers import start_router, start_stubs  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "router.md")
TARGETS = {"p50": 2.0, "p99": 10.0}  # ms added


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def measure(requests_n: int, warmup: int) -> dict:
    import requests

    servers: list = []
    try:
        stubs = start_stubs(2, servers)   # benchlib/stub.py: aiohttp, answers at once
        router = start_router(stubs, servers, 30)
        ports = [s.port for s in stubs]
        router_port = router.port
        session = requests.Session()
        session.trust_env = False
        kinds = {"one prompt (to one replica)": {"prompt": [1, 2, 3], "max_tokens": 3},
                 "two prompts (split over both)": {"prompt": [[1, 2, 3], [4, 5, 6]], "max_tokens": 3}}
        urls = {"direct": f"http://127.0.0.1:{ports[0]}/v1/completions",
                "router": f"http://127.0.0.1:{router_port}/v1/completions"}
        result: dict = {"kinds": {}}
        for body in kinds.values():
            for _ in range(warmup):
                for url in urls.values():
                    session.post(url, json=body).raise_for_status()
        result["rss_before"] = _rss(router.proc.pid)
        t0 = time.perf_counter()
        times = {name: {"direct": [], "router": []} for name in kinds}
        for _ in range(requests_n):  # kinds and paths interleaved, so load from other jobs hits them alike
            for name, body in kinds.items():
                for via, url in urls.items():
                    t = time.perf_counter()
                    r = session.post(url, json=body)
                    times[name][via].append((time.perf_counter() - t) * 1000)
                    r.raise_for_status()
        for name, by_path in times.items():
            result["kinds"][name] = {via: {"p50": _pct(v, 50), "p99": _pct(v, 99), "mean": statistics.fmean(v)}
                                     for via, v in by_path.items()}
        result["seconds"] = time.perf_counter() - t0
        result["rss_after"] = _rss(router.proc.pid)
        result["routed"] = requests_n * len(kinds)
        return result
    finally:
        for s in servers:
            s.stop(grace_s=2)


def report(res: dict, requests_n: int) -> str:
    lines = ["# Router overhead per request (loopback)", "",
             f"{requests_n:,} requests per kind and path, alternating direct / through the router, one kept-alive "
             f"client; 2 stub replicas that answer at once. `python benchmarks/router_overhead.py` "
             f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}).", "",
             "| request | direct p50 ms | router p50 ms | added p50 ms | direct p99 ms | router p99 ms | added p99 ms "
             "| target (added p50 / p99) |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, r in res["kinds"].items():
        added = {q: r["router"][q] - r["direct"][q] for q in ("p50", "p99")}
        ok = all(added[q] < TARGETS[q] for q in TARGETS)
        lines.append(f"| {name} | {r['direct']['p50']:.2f} | {r['router']['p50']:.2f} | {added['p50']:.2f} "
                     f"| {r['direct']['p99']:.2f} | {r['router']['p99']:.2f} | {added['p99']:.2f} "
                     f"| < {TARGETS['p50']:g} / < {TARGETS['p99']:g}: {'PASS' if ok else 'FAIL'} |")
    load = os.getloadavg()
    lines += ["",
              f"- Router resident memory: {res['rss_before'] / 2**20:.1f} MiB after warm-up, "
              f"{res['rss_after'] / 2**20:.1f} MiB after {res['routed']:,} more routed requests.",
              "- Added = router percentile minus direct percentile; the router's extra hop is a second HTTP "
              "exchange on loopback plus JSON parsing (split requests only).",
              f"- Machine: {platform.platform()}, {os.cpu_count()} cores, load average {load[0]:.1f} / {load[1]:.1f} "
              f"/ {load[2]:.1f} (1/5/15 min, shared with other jobs); Python {platform.python_version()}; "
              f"{res['seconds']:.1f} s of timed requests."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=5000, help="timed requests per kind and path")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--out", default=OUT)
    args = p.parse_args(argv)
    res = measure(args.requests, args.warmup)
    text = report(res, args.requests)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
