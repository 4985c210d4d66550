"""(helper of weight_sync_bench.py) The report: tables, what the time beyond the plain broadcast is spent on, the
machine; and synthetic rows for `--fake`. Pure: no processes, no torch."""
from __future__ import annotations

import os
import platform
import statistics

TARGET = 0.5   # the sync's MB/s over the plain broadcast's
CLIENT_PHASES = ("start_post", "pack", "broadcast", "update_tail", "finish_post", "reset_post")
SERVER_PHASES = ("start", "recv", "load", "unpack", "finish")


# -- the report -------------------------------------------------------------------------------------------------
def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def _spread(xs: list[float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(_med(xs))} ({fmt.format(min(xs))}–{fmt.format(max(xs))})"


def report(rows: list[dict], meta: dict) -> str:
    lines = ["# Weight sync to vLLM CPU replicas over gloo, against a plain gloo broadcast", "",
             f"`{meta['command']}` ({meta['when']}). Each row: {meta['reps']} repetitions after one untimed sync; "
             "each repetition is a plain torch.distributed gloo broadcast of the same packed chunks (this process to "
             "one receiver process per replica) immediately followed by one full sync (TRL 1.16's `VLLMClient`, "
             "dualrun's gloo path, through dualrun's router: `update_named_params` of every parameter, then "
             "`reset_prefix_cache`, as GRPOTrainer's `sync_weights`). MB = 10^6 bytes, per replica; "
             "median (min–max).", "",
             "| model | params | MB moved (chunks) | replicas | sync s | sync MB/s | plain broadcast s | "
             "broadcast MB/s | sync / broadcast MB/s | target >= 0.5 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        mb = r["bytes"] / 1e6
        sync = [x["total"] for x in r["runs"]]
        base = [x["baseline"] for x in r["runs"]]
        ratios = [x["baseline"] / x["total"] for x in r["runs"]]
        ok = "PASS" if _med(ratios) >= TARGET else "FAIL"
        lines.append(f"| {r['model']} | {r['params'] / 1e6:.2f}M | {mb:.1f} ({r['chunks']}) | {r['replicas']} | "
                     f"{_spread(sync, '{:.3f}')} | {_spread([mb / s for s in sync], '{:.0f}')} | "
                     f"{_spread(base, '{:.3f}')} | {_spread([mb / s for s in base], '{:.0f}')} | "
                     f"{_spread(ratios, '{:.3f}')} | {ok} |")
    lines += ["", "## Where the sync's time goes", "",
              "Seconds, median over the repetitions. Trainer side (this process's clock): **start**, **finish**, "
              "**reset**: the `/start_weight_update`, `/finish_weight_update`, `/reset_prefix_cache` round trips "
              "through the router; **pack**: `pack_tensors` copying parameters into chunks; **broadcast**: the "
              "trainer's broadcast waits (each also waits for the workers to be ready for that chunk, i.e. for "
              "their `load_weights` of the previous one); **tail**: from the last broadcast until `/update_weights` "
              "returns (the workers load the last chunk). Worker side (the slowest replica, "
              "benchmarks/weight_sync_timing.py): **recv** (broadcast waits), **load** (vLLM's `load_weights`), "
              "**unpack**, **start**/**finish** (vLLM's layerwise reload init / finalize, the CPU repack).", "",
              "| model | replicas | sync | plain broadcast | trainer: start | pack | broadcast | tail | finish | reset "
              "| worker: start | recv | load | unpack | finish |", "|---|---:|" + "---:|" * 13]
    for r in rows:
        c = {k: _med([x[k] for x in r["runs"]]) for k in ("total", "baseline", *CLIENT_PHASES)}
        s = {k: _med([max(srv.get(k, 0.0) for srv in x["server"]) for x in r["runs"]]) for k in SERVER_PHASES}
        lines.append(f"| {r['model']} | {r['replicas']} | {c['total']:.3f} | {c['baseline']:.3f} | "
                     + " | ".join(f"{c[k]:.3f}" for k in CLIENT_PHASES) + " | "
                     + " | ".join(f"{s[k]:.3f}" for k in SERVER_PHASES) + " |")
    lines += ["", "## What the sync's time is spent on", "",
              "Per row, medians over the repetitions of the trainer-side parts (they add up to the sync; the trainer "
              "packs a chunk only after the previous chunk's broadcast returned, so packing and transfer do not "
              "overlap), and the workers' own timings:", ""]
    lines += [f"- {attribution(r)}" for r in rows]
    loads = [x["load"] for r in rows for x in r["runs"]]
    lines += ["", "## Machine", "",
              f"- {platform.platform()}, {os.cpu_count()} cores, shared with other engineers' jobs; load average "
              f"(1 min) at each repetition: {min(loads):.1f}–{max(loads):.1f} (median {_med(loads):.1f}); at the end "
              f"{meta['load_end']}. On a loaded machine every number here is inflated and noisy: read the ratio of "
              "each repetition's sync to the broadcast measured just before it.",
              f"- Python {platform.python_version()}, {meta['versions']}.", ""]
    return "\n".join(lines)


def attribution(row: dict) -> str:
    """Pure: one line splitting the sync's time into its parts (medians over the repetitions)."""
    runs = row["runs"]
    med = {k: _med([x[k] for x in runs]) for k in ("total", "baseline", *CLIENT_PHASES)}
    trips = _med([x["start_post"] + x["finish_post"] + x["reset_post"] for x in runs])
    other = _med([x["total"] - sum(x[k] for k in CLIENT_PHASES) for x in runs])
    slowest = {k: _med([max(srv.get(k, 0.0) for srv in x["server"]) for x in runs]) for k in SERVER_PHASES}
    share = (lambda s: f" ({s / med['total']:.0%})") if med["total"] > 0 else (lambda s: "")
    return (f"**{row['model']}, {row['replicas']} replica{'s' if row['replicas'] > 1 else ''}**: sync "
            f"{med['total']:.3f} s = packing on the trainer {med['pack']:.3f} s{share(med['pack'])} + broadcast "
            f"waits {med['broadcast']:.3f} s{share(med['broadcast'])} [the plain broadcast of the same bytes: "
            f"{med['baseline']:.3f} s] + the last chunk's load and /update_weights' return {med['update_tail']:.3f} s"
            f" + start/finish/reset round trips {trips:.3f} s{share(trips)} + other {other:.3f} s. In the "
            f"(slowest) worker: vLLM's load_weights {slowest['load']:.3f} s in all (overlapping the trainer's "
            f"packing of the next chunk), unpacking {slowest['unpack']:.3f} s, layerwise-reload start "
            f"{slowest['start']:.3f} s and finish {slowest['finish']:.3f} s.")


def fake_rows(reps: int) -> list[dict]:
    """Synthetic numbers in the shape `measure_model` returns (for `--fake`: the report without any process)."""
    rows = []
    for name, params, chunks in (("tiny", 0.02e6, 1), ("100M", 101e6, 7)):
        for replicas in (1, 2):
            nbytes = int(params * 4)
            runs = [{"total": 0.05 + nbytes / 4e8 * replicas, "baseline": 0.002 + nbytes / 1e9 * replicas,
                     "load": 10.0 + i,
                     **{k: 0.01 for k in CLIENT_PHASES},
                     "server": [{k: 0.01 for k in SERVER_PHASES} for _ in range(replicas)]} for i in range(reps)]
            rows.append({"model": name, "params": params, "bytes": nbytes, "chunks": chunks, "replicas": replicas,
                         "runs": runs})
    return rows
