"""dualrun's router against vllm-router (the vLLM project's Rust router) in front of the same replicas.

    pip install vllm-router==0.1.17          # the version measured; not a dependency of dualrun
    unshare -n bash -c 'ip link set lo up; python benchmarks/router_vs_vllm.py'              # ~7 min, 2 busy cores
    unshare -n bash -c 'ip link set lo up; python benchmarks/router_vs_vllm.py --no-engines' # stubs only, ~3 min

Two replicas stand behind both routers at once: stub replicas that answer at once (benchlib/stub.py: what is timed
is the routers' hop), then 2 of dualrun's CPU engines on the tiny model (a real generation behind it). A closed-loop
client (benchlib/load.py) keeps 1, 8, 64 and 256 requests in flight, three ways: straight to the replicas (the client
alternates between them: no router), through dualrun's router, through vllm-router (round robin, health probe every
second as dualrun's). Two requests: a one-prompt /v1/completions (both routers send it whole to one replica) and a
32-prompt one (dualrun's router splits it over both replicas; vllm-router sends it whole to one). Every
(request, in-flight) cell runs the three ways back to back, in an order that rotates, `--reps` times, so load from
other jobs hits them alike. Added latency = the router's percentile minus the direct one of the same repetition.
Also each router process's CPU time per request (from /proc: less noisy than latency on a shared machine).
Writes results/router_vs_vllm.md (every run in results/router_vs_vllm.json).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from benchlib import RESULTS  # noqa: E402
from benchlib.load import closed_loop  # noqa: E402
from benchlib.measure import proc_stats  # noqa: E402
from benchlib.noise import machine  # noqa: E402
from benchlib.servers import (VLLM_ROUTER_INSTALL, start_cpu_engines, start_router, start_stubs,  # noqa: E402
                              start_vllm_router, vllm_router_bin)

OUT = RESULTS / "router_vs_vllm.md"
WAYS = ("direct", "dualrun", "vllm-router")
KINDS = ("1 prompt", "32 prompts")


def bodies(max_tokens: int) -> dict[str, bytes]:
    """The two requests, as TRL's client sends them (token-id prompts, greedy)."""
    prompt = [11, 12, 13, 14, 15, 16, 17, 18]
    one = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    many = dict(one, prompt=[[t + i % 30 for t in prompt] for i in range(32)])
    return {"1 prompt": json.dumps(one).encode(), "32 prompts": json.dumps(many).encode()}


def _cpu(server) -> float:
    return proc_stats(server.proc.pid)[1] or 0.0


def run_backend(replicas: list, stack: list, kinds: dict[str, bytes], inflight: list[int], reps: int,
                requests_for) -> list[dict]:
    """Every (rep, kind, in-flight, way) once, the ways' order rotating; one row each."""
    routers = {"dualrun": start_router(replicas, stack), "vllm-router": start_vllm_router(replicas, stack)}
    urls = {"direct": [f"http://{s.address}/v1/completions" for s in replicas],
            **{w: [f"http://{r.address}/v1/completions"] for w, r in routers.items()}}
    rows = []
    turn = 0
    for rep in range(reps):
        for kind, body in kinds.items():
            for c in inflight:
                n = requests_for(kind, c)
                if n <= 0:
                    continue
                turn += 1
                for way in WAYS[turn % 3:] + WAYS[:turn % 3]:
                    load = os.getloadavg()[0]
                    before = _cpu(routers[way]) if way in routers else 0.0
                    r = closed_loop(urls[way], body, c, n)
                    cpu = _cpu(routers[way]) - before if way in routers else None
                    rows.append({"rep": rep, "kind": kind, "c": c, "way": way, "load": load,
                                 "cpu_us": None if cpu is None else cpu / (r["n"] + c) * 1e6, **r})
                    print(f"rep {rep} {kind:10} {c:3} in flight  {way:11} p50 {r['p50']:7.2f} ms  p99 "
                          f"{r['p99']:7.2f} ms  {r['rps']:7.0f} req/s  load {load:.1f}", file=sys.stderr, flush=True)
    return rows


def measure(args: argparse.Namespace) -> dict:
    out: dict = {"machine": machine(), "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "backends": {}}
    stack: list = []
    try:
        replicas = start_stubs(2, stack)
        out["backends"]["stub replicas (answer at once)"] = run_backend(
            replicas, stack, bodies(3), args.inflight, args.reps,
            lambda kind, c: max(args.requests, args.per_inflight * c))
    finally:
        for s in reversed(stack):
            s.stop(grace_s=2)
    if args.engines:
        stack = []
        try:
            model = args.model or _tiny_model()
            replicas = start_cpu_engines(model, 2, stack)
            out["backends"][f"2 CPU engines (tiny model, {args.engine_max_tokens} new tokens)"] = run_backend(
                replicas, stack, bodies(args.engine_max_tokens), args.inflight, args.engine_reps,
                lambda kind, c: (max(4 * c, 32) if kind == "1 prompt" else (max(2 * c, 8) if c <= 8 else 0)))
        finally:
            for s in reversed(stack):
                s.stop(grace_s=2)
    out["ended_load"] = os.getloadavg()
    return out


def _tiny_model() -> str:
    tmp = tempfile.mkdtemp(prefix="dualrun-bench-")
    subprocess.run([sys.executable, os.path.join(ROOT, "examples", "make_tiny_model.py"), "--out", tmp], check=True,
                   capture_output=True)
    return os.path.join(tmp, "model")


def _spread(values: list[float], fmt: str = "{:.2f}") -> str:
    if not values:
        return "-"
    med = statistics.median(values)
    if len(values) == 1:
        return fmt.format(med)
    return f"{fmt.format(med)} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def _cells(rows: list[dict]) -> dict:
    """(kind, c) -> way -> list of rows, one per rep; and the added latencies per rep."""
    cells: dict = {}
    for r in rows:
        cells.setdefault((r["kind"], r["c"]), {}).setdefault(r["way"], {})[r["rep"]] = r
    return cells


def verdict(rows: list[dict]) -> list[str]:
    """The target on one-prompt requests, cell by cell, on the medians."""
    lines = []
    for (kind, c), ways in sorted(_cells(rows).items()):
        if kind != "1 prompt":
            continue
        added = {w: {q: statistics.median(ways[w][k][q] - ways["direct"][k][q] for k in ways[w])
                     for q in ("p50", "p99")} for w in ("dualrun", "vllm-router")}
        rps = {w: statistics.median(r["rps"] for r in ways[w].values()) for w in ("dualrun", "vllm-router")}
        lat_ok = all(added["dualrun"][q] <= added["vllm-router"][q] for q in ("p50", "p99"))
        rps_ok = rps["dualrun"] >= rps["vllm-router"] or c > 64
        lines.append(f"| {c} | {added['dualrun']['p50']:.2f} / {added['dualrun']['p99']:.2f} | "
                     f"{added['vllm-router']['p50']:.2f} / {added['vllm-router']['p99']:.2f} | "
                     f"{'PASS' if lat_ok else 'FAIL'} | {rps['dualrun'] / rps['vllm-router']:.2f}x | "
                     f"{'PASS' if rps_ok else 'FAIL'}{' (not required above 64)' if c > 64 else ''} |")
    return lines


def report(res: dict, args: argparse.Namespace, command: str) -> str:
    m = res["machine"]
    lines = ["# dualrun's router against vllm-router", "",
             f"`{command}` ({res['started']}; dualrun {m.get('git', '?')}, vllm-router "
             f"{_vllm_router_version()}, aiohttp {_version('aiohttp')}, uvloop {_version('uvloop')}: dualrun's router runs "
             "on uvloop where it is installed).", "",
             "2 replicas behind each router; a closed-loop client keeps N requests in flight: straight to the "
             "replicas (alternating: no router), through dualrun's router, through vllm-router (round robin). "
             "Every cell is the median of the repetitions, (min–max) beside it; *added* = the router's percentile "
             "minus the direct one of the same repetition; router CPU = the router process's CPU time per request.",
             ""]
    for backend, rows in res["backends"].items():
        reps = len({r["rep"] for r in rows})
        lines += [f"## {backend}", "", f"{reps} repetitions; requests per cell: "
                  + ", ".join(sorted({f'{r["n"]} at {r["c"]}' for r in rows if r["way"] == "direct"
                                      and r["kind"] == "1 prompt"}, key=lambda s: int(s.split()[-1])))
                  + f" in flight (one prompt). Load average (1 min) at the runs' start: "
                  f"{min(r['load'] for r in rows):.1f}–{max(r['load'] for r in rows):.1f}.", ""]
        for kind in KINDS:
            cells = {c: ways for (k, c), ways in sorted(_cells(rows).items()) if k == kind}
            if not cells:
                continue
            lines += [f"### {kind}", "",
                      "| in flight | direct p50 / p99 ms | direct req/s | dualrun added p50 ms | dualrun added p99 ms "
                      "| dualrun req/s | dualrun CPU µs/req | vllm-router added p50 ms | vllm-router added p99 ms "
                      "| vllm-router req/s | vllm-router CPU µs/req |",
                      "|---:|---|---|---|---|---|---|---|---|---|---|"]
            for c, ways in cells.items():
                d = ways["direct"]
                row = [str(c), f"{statistics.median(r['p50'] for r in d.values()):.2f} / "
                       f"{statistics.median(r['p99'] for r in d.values()):.2f}",
                       _spread([r["rps"] for r in d.values()], "{:.0f}")]
                for w in ("dualrun", "vllm-router"):
                    row += [_spread([ways[w][k][q] - d[k][q] for k in ways[w]]) for q in ("p50", "p99")]
                    row += [_spread([r["rps"] for r in ways[w].values()], "{:.0f}"),
                            _spread([r["cpu_us"] for r in ways[w].values()], "{:.0f}")]
                lines.append("| " + " | ".join(row) + " |")
            lines.append("")
        if not backend.startswith("stub"):
            lines += ["A generation takes tens to hundreds of ms here, so a router's fraction of a ms is inside the "
                      "spread between repetitions: what this part shows is that both routers keep the engines busy "
                      "(req/s) and what splitting is worth — direct and vllm-router send a 32-prompt request whole "
                      "to one engine, dualrun's router splits it over both (a negative *added*: faster than one "
                      "engine). 32-prompt requests only up to 8 in flight (each is 32 generations).", ""]
        if backend.startswith("stub"):
            lines += ["### Target (one prompt): dualrun adds no more than vllm-router; req/s at least its up to 64",
                      "", "| in flight | dualrun added p50 / p99 ms | vllm-router added p50 / p99 ms | latency "
                      "| req/s dualrun / vllm-router | req/s |", "|---:|---|---|---|---|---|", *verdict(rows), ""]
    end = res["ended_load"]
    lines += ["## Machine", "",
              f"{m['platform']}, {m['cpus']} cores ({m.get('cpu', '?')}), {m.get('mem_total_gib', '?')} GiB, "
              f"Python {m['python']}; shared with other jobs (load average at the end {end[0]:.1f} / {end[1]:.1f} / "
              f"{end[2]:.1f}, 1/5/15 min). The client, both routers and the replicas share these cores: at 64 and "
              "256 in flight a router's latency is mostly how long requests queue for its CPU, so req/s and CPU per "
              "request say more than the latency there.", ""]
    return "\n".join(lines)


def _version(pkg: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg)
    except PackageNotFoundError:
        return "-"


def _vllm_router_version() -> str:
    """vllm-router's version, also where it is installed in an environment of its own (its script's interpreter)."""
    here = _version("vllm-router")
    binary = vllm_router_bin()
    if here != "-" or binary is None:
        return here
    try:
        with open(binary, "rb") as f:
            first = f.readline()
        if not first.startswith(b"#!"):
            return "-"
        r = subprocess.run([first[2:].decode().strip(), "-c", "from importlib.metadata import version; "
                            "print(version('vllm-router'))"], capture_output=True, text=True, timeout=60)
        return r.stdout.strip() or "-"
    except (OSError, UnicodeDecodeError, subprocess.SubprocessError):
        return "-"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--inflight", type=int, nargs="+", default=[1, 8, 64, 256], help="requests in flight")
    p.add_argument("--reps", type=int, default=3, help="repetitions of every stub cell")
    p.add_argument("--requests", type=int, default=600, help="timed requests per stub cell, at least")
    p.add_argument("--per-inflight", type=int, default=10, help="...and at least this many per request in flight")
    p.add_argument("--engines", action=argparse.BooleanOptionalAction, default=True,
                   help="also 2 CPU engines on the tiny model (32 prompts only up to 8 in flight)")
    p.add_argument("--engine-reps", type=int, default=2)
    p.add_argument("--engine-max-tokens", type=int, default=4)
    p.add_argument("--model", default=None, help="a causal LM dir for the engines (default: the tiny model)")
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    if vllm_router_bin() is None:
        print(f"router_vs_vllm: vllm-router is not installed; `{VLLM_ROUTER_INSTALL}` (into this environment)",
              file=sys.stderr)
        return 2
    command = "python benchmarks/router_vs_vllm.py" + (" " + " ".join(argv if argv is not None else sys.argv[1:])
                                                       if (argv if argv is not None else sys.argv[1:]) else "")
    res = measure(args)
    text = report(res, args, command)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:   # every run, for another look
        json.dump(res, f, indent=1)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
