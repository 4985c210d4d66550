"""Router overhead per request on loopback: the same requests straight to a replica and through the router.

    unshare -n bash -c 'ip link set lo up; python benchmarks/router_overhead.py'      # about 40 s

Two stub replicas (processes that answer at once, so that the time measured is transport, not inference) stand
behind `dualrun.serving.router` (a process). One client with a kept-alive connection alternates: a request straight
to replica 0, the same request through the router, the two kinds below interleaved. Two kinds: a single-prompt /v1/completions (goes to one replica
whole) and a two-prompt one (split over both replicas, answers merged). Added latency = router percentile minus
direct percentile. The router's resident memory is read before and after the timed requests. Writes
results/router.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "router.md")
TARGETS = {"p50": 2.0, "p99": 10.0}  # ms added, from issue 13


def stub(port: int) -> None:
    """A replica that answers at once: one choice per prompt."""

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # headers and body go out in two writes: no 40 ms delayed-ACK stall

        def log_message(self, *a: object) -> None:
            pass

        def _send(self, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802
            self._send({"world_size": 1} if self.path.startswith("/get_world_size") else {"status": "ok"})

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            prompts = body["prompt"] if isinstance(body.get("prompt"), list) and body["prompt"] and \
                isinstance(body["prompt"][0], list) else [body.get("prompt")]
            self._send({"id": "x", "choices": [{"index": i, "token_ids": [1, 2, 3], "text": "a b c"}
                                               for i in range(len(prompts))],
                        "usage": {"prompt_tokens": 3, "completion_tokens": 3}})

    ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if q < 100 else max(values)


def measure(requests_n: int, warmup: int) -> dict:
    import requests

    from dualrun.light.ports import free_port
    from dualrun.servers.process import ServerProcess
    from dualrun.serving.router import router_argv

    servers = []
    try:
        ports = [free_port(), free_port()]
        for port in ports:
            servers.append(ServerProcess(f"stub {port}", [sys.executable, __file__, "--stub", str(port)],
                                         dict(os.environ), "127.0.0.1", port, "/health", 30, stream=None).start())
        router_port = free_port()
        router = ServerProcess("router", router_argv("127.0.0.1", router_port, [f"127.0.0.1:{p}" for p in ports]),
                               dict(os.environ), "127.0.0.1", router_port, "/health", 30, stream=None).start()
        servers.append(router)
        for s in servers:
            s.wait_healthy()
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
    p.add_argument("--stub", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.stub:
        stub(args.stub)
        return 0
    res = measure(args.requests, args.warmup)
    text = report(res, args.requests)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
