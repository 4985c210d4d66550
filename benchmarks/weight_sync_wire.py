"""The weight sync's wire alone: dualrun's stream (`dualrun.weightsync.stream`: the trainer's Sender, a chain of
relaying Receivers) against gloo's own broadcast of the same chunks, between plain processes (no vLLM, nothing
loaded: the receivers' `load` does nothing), on loopback or on a virtual cluster of machines whose links are shaped
with `tc tbf`.

    bash scripts/in-loopback.sh .venv/bin/python benchmarks/weight_sync_wire.py --loopback        # 1, 2, 4 receivers
    .venv/bin/python benchmarks/weight_sync_wire.py --rates 1gbit,5gbit   # root: tests/support/vcluster.py's machines

On the virtual cluster the trainer (rank 0) runs on machine 0 and each receiver on a machine of its own; every
machine's link is limited to the rate both ways. Each repetition runs both ways in the same group, alternating
which goes first: gloo's broadcast of the packed chunks (buffers allocated once at both ends), then dualrun's
stream of the model's tensors (packing included). Writes the rows as JSON (`--json`); weight_sync_bench.py puts
them in its report (`--wire-json`).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import timedelta

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, ROOT)

# The ~100M-parameter Llama of weight_sync_bench.py (hidden 1024, 8 layers, MLP 2816, the tiny tokenizer's 79
# tokens, tied embeddings; 102.86M parameters): their shapes in `named_parameters()` order, float32.
VOCAB, HIDDEN, MLP, LAYERS = 79, 1024, 2816, 8


def model_shapes() -> list[list[int]]:
    layer = [[HIDDEN, HIDDEN]] * 4 + [[MLP, HIDDEN], [MLP, HIDDEN], [HIDDEN, MLP], [HIDDEN], [HIDDEN]]
    return [[VOCAB, HIDDEN], *layer * LAYERS, [HIDDEN]]


# -- one member of the group ------------------------------------------------------------------------------------
def member(spec: dict) -> dict:
    """Join the group at spec's address, then per repetition both ways, timed from a barrier to a barrier."""
    import torch
    from torch.distributed import ProcessGroupGloo

    from dualrun.weightsync.stream import Receiver, Sender
    from dualrun.weightsync.wire import PACKED_BUFFER_BYTES, chunk_bounds, group_store, tcp_store

    rank, world = spec["rank"], spec["world"]
    timeout = timedelta(seconds=300)
    store = tcp_store(spec["address"], spec["port"], rank, world, timeout)
    group = ProcessGroupGloo(group_store(store, spec["address"], spec["port"]), rank, world, timeout)
    shapes = model_shapes()
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=gen) for s in shapes] if rank == 0 else []
    sizes = [4 * _numel(s) for s in shapes]
    per_chunk = [sizes[a:b] for a, b in chunk_bounds(sizes, PACKED_BUFFER_BYTES)]
    chunks = [torch.empty(sum(n), dtype=torch.uint8) for n in per_chunk]
    if rank == 0:
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])
        offset = 0
        for c in chunks:
            c.copy_(flat[offset:offset + c.numel()])
            offset += c.numel()
        del flat
    sender = Sender(group, PACKED_BUFFER_BYTES, spec["segment"]) if rank == 0 else None
    receiver = Receiver(group, rank, world, PACKED_BUFFER_BYTES, spec["segment"]) if rank else None
    checksum = [0]

    def load(index: int, chunk) -> None:  # noqa: ANN001 - nothing loaded: the wire alone (first chunk checked)
        if index == 0 and not checksum[0]:
            checksum[0] = int(chunk[:4096].sum())

    runs = []
    for rep in range(spec["reps"] + 1):   # the first: untimed (connections, first buffers)
        record: dict = {}
        modes = ("broadcast", "stream") if rep % 2 == 0 else ("stream", "broadcast")
        for mode in modes:
            group.barrier().wait()
            t0, cpu0 = time.perf_counter(), time.process_time()   # every thread's CPU: gloo's included
            if mode == "broadcast":
                for c in chunks:
                    group.broadcast(c, 0).wait()
            elif sender is not None:
                sender.send(tensors)
                record["pack_s"], record["send_wait_s"] = sender.stats["pack_s"], sender.stats["wait_s"]
            else:
                receiver.receive(per_chunk, load)
                record["recv_s"] = receiver.stats["recv_s"]
            group.barrier().wait()
            record[mode] = time.perf_counter() - t0
            record[f"{mode}_cpu_s"] = time.process_time() - cpu0
        if rep:
            runs.append(record)
    expected = int(tensors[0].reshape(-1).view(torch.uint8)[:4096].sum()) if rank == 0 else checksum[0]
    return {"rank": rank, "runs": runs, "bytes": sum(sizes), "chunks": len(per_chunk), "checksum": checksum[0],
            "expected": expected}


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# -- layouts ----------------------------------------------------------------------------------------------------
def run_layout(receivers: int, reps: int, spawn, address: str, port: int, segment: int) -> dict:  # noqa: ANN001
    """One group: rank 0 and `receivers` more, each started by `spawn(rank, argv)`; their reports."""
    procs = []
    for rank in range(receivers + 1):
        spec = {"address": address, "port": port, "rank": rank, "world": receivers + 1, "reps": reps,
                "segment": segment}
        procs.append(spawn(rank, [sys.executable, os.path.abspath(__file__), "member", json.dumps(spec)]))
    reports = []
    for p in procs:
        out, _ = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"a member exited with {p.returncode}: {out[-2000:]}")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    bad = [r["rank"] for r in reports[1:] if r["checksum"] != reports[0]["expected"]]
    if bad:
        raise RuntimeError(f"ranks {bad} received other bytes than rank 0 sent")
    return {"receivers": receivers, "bytes": reports[0]["bytes"], "chunks": reports[0]["chunks"],
            "runs": [{**r0, "recv_s": max(r["runs"][i].get("recv_s", 0.0) for r in reports[1:]),
                      **{f"{m}_cpu_s": sum(r["runs"][i].get(f"{m}_cpu_s", 0.0) for r in reports)
                         for m in ("broadcast", "stream")}}
                     for i, r0 in enumerate(reports[0]["runs"])]}


def loopback(layouts: list[int], reps: int, segment: int) -> list[dict]:
    from dualrun.light.ports import free_port

    def spawn(rank: int, argv: list[str]) -> subprocess.Popen:
        return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    rows = []
    for n in layouts:
        load = os.getloadavg()[0]
        rows.append({"link": "loopback", "rate_bps": None, "load": load,
                     **run_layout(n, reps, spawn, "127.0.0.1", free_port("127.0.0.1"), segment)})
    return rows


def _bits(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, scale in units.items():
        if rate.lower().endswith(unit):
            return float(rate[:-len(unit)]) * scale
    raise ValueError(f"a rate like 1gbit or 500mbit, got {rate!r}")


def shaped(rates: list[str], layouts: list[int], reps: int, segment: int) -> list[dict]:
    """The trainer on machine 0 and each receiver on its own machine, every link limited to `rate` both ways."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "support"))
    from vcluster import VCluster

    rows = []
    with VCluster(1 + max(layouts)) as vc:
        port = 29600
        for rate in rates:
            burst = f"{max(32, int(_bits(rate) / 8 / 1000 / 250))}kb"   # a tick's worth of bytes at 250 Hz
            for k in range(1 + max(layouts)):
                vc.slow(k, rate, burst=burst)
            for n in layouts:
                port += 1
                env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0"}

                def spawn(rank: int, argv: list[str]) -> subprocess.Popen:
                    return vc.popen(rank, argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True)
                load = os.getloadavg()[0]
                rows.append({"link": rate, "rate_bps": _bits(rate), "burst": burst, "load": load,
                             **run_layout(n, reps, spawn, vc.address(0), port, segment)})
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "runs"}), file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["member"]:
        print(json.dumps(member(json.loads(argv[1]))), flush=True)
        return 0
    from dualrun.weightsync.wire import SEGMENT_BYTES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loopback", action="store_true", help="every member on 127.0.0.1 (no virtual cluster)")
    p.add_argument("--rates", default="1gbit,5gbit", help="the virtual cluster's link rates, comma-separated")
    p.add_argument("--receivers", default="1,2,4", help="the layouts: receivers per group, comma-separated")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--segment", type=int, default=SEGMENT_BYTES, help="bytes each rank passes on at once")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    layouts = [int(n) for n in args.receivers.split(",")]
    rows = (loopback(layouts, args.reps, args.segment) if args.loopback
            else shaped(args.rates.split(","), layouts, args.reps, args.segment))
    load = os.getloadavg()
    command = ("bash scripts/in-loopback.sh .venv/bin/python benchmarks/weight_sync_wire.py --loopback"
               if args.loopback else f".venv/bin/python benchmarks/weight_sync_wire.py --rates {args.rates}")
    out = {"command": command + (f" --receivers {args.receivers}" if args.receivers != "1,2,4" else "")
           + (f" --reps {args.reps}" if args.reps != 3 else ""),
           "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "reps": args.reps, "segment": args.segment,
           "load_end": f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1/5/15 min)", "rows": rows}
    text = json.dumps(out, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    for row in rows:
        for run in row["runs"]:
            print(f"{row['link']} receivers={row['receivers']}: broadcast {run['broadcast']:.2f} s "
                  f"({run['broadcast_cpu_s']:.2f} CPU-s), stream {run['stream']:.2f} s ({run['stream_cpu_s']:.2f} "
                  f"CPU-s; pack {run.get('pack_s', 0):.2f}, load {row['load']:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
