"""(helper of weight_sync_bench.py) The report: the full sync to vLLM replicas on loopback against a plain gloo
broadcast, where its time goes, the wire alone (weight_sync_wire.py) on loopback and on shaped links, the machine;
and synthetic rows for `--fake`. Pure: no processes, no torch (the chart is in weight_sync_chart.py)."""
from __future__ import annotations

import os
import platform
import statistics

TARGET = 0.9          # loopback: the full sync's MB/s over the plain broadcast's, per repetition
LINK_TARGET = 0.8     # shaped links, 1 receiver: the stream's MB/s over the link's rate
FAN_TARGET = 1.5      # shaped links: 4 receivers' time over 1 receiver's
CLIENT_PHASES = ("start_post", "pack", "wire", "send_other", "update_tail", "finish_post", "reset_post")
SERVER_PHASES = ("start", "recv", "load", "relay", "finish")


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def _spread(xs: list[float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(_med(xs))} ({fmt.format(min(xs))}–{fmt.format(max(xs))})"


# -- the full sync (vLLM replicas, loopback) --------------------------------------------------------------------
def sync_ratios(row: dict) -> list[float]:
    """Each repetition's sync MB/s over the plain broadcast's measured just before it (= broadcast s / sync s)."""
    return [x["baseline"] / x["total"] for x in row["runs"]]


def sync_table(rows: list[dict]) -> list[str]:
    lines = ["| model | params | MB moved (chunks) | replicas | sync s | sync MB/s | plain broadcast s | "
             f"broadcast MB/s | sync / broadcast | limit: >= {TARGET} of the broadcast |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        mb = r["bytes"] / 1e6
        sync = [x["total"] for x in r["runs"]]
        base = [x["baseline"] for x in r["runs"]]
        ratios = sync_ratios(r)
        ok = "PASS" if min(ratios) >= TARGET else ("PASS (median)" if _med(ratios) >= TARGET else "FAIL")
        lines.append(f"| {r['model']} | {r['params'] / 1e6:.2f}M | {mb:.1f} ({r['chunks']}) | {r['replicas']} | "
                     f"{_spread(sync, '{:.3f}')} | {_spread([mb / s for s in sync], '{:.0f}')} | "
                     f"{_spread(base, '{:.3f}')} | {_spread([mb / s for s in base], '{:.0f}')} | "
                     f"{_spread(ratios, '{:.3f}')} | {ok} |")
    return lines


def landed_lines(rows: list[dict]) -> list[str]:
    """Pure: the check that each layout's syncs put the trainer's weights in every replica."""
    checked = [r for r in rows if r.get("landed")]
    if not checked:
        return []
    said = "; ".join(f"{r['model']}, {r['replicas']} replica{'s' * (r['replicas'] > 1)}: at most "
                     f"{max(r['landed']['gaps']):.1e} (moved {r['landed']['moved']:.2f})" for r in checked)
    return ["The weights landed: after the timed syncs every parameter was perturbed and synced once more; each "
            "replica's log-probabilities of a fixed prompt then differed from the trainer model's by (vLLM's CPU "
            f"kernels against transformers', limit 1e-3; the perturbation moved them by): {said}.", ""]


def phases_table(rows: list[dict]) -> list[str]:
    lines = ["| model | replicas | sync | plain broadcast | trainer: start | pack | wire | other | tail | finish | "
             "reset | worker: start | recv | load | relay | finish |", "|---|---:|" + "---:|" * 14]
    for r in rows:
        c = {k: _med([x[k] for x in r["runs"]]) for k in ("total", "baseline", *CLIENT_PHASES)}
        s = {k: _med([max(srv.get(k, 0.0) for srv in x["server"]) for x in r["runs"]]) for k in SERVER_PHASES}
        lines.append(f"| {r['model']} | {r['replicas']} | {c['total']:.3f} | {c['baseline']:.3f} | "
                     + " | ".join(f"{c[k]:.3f}" for k in CLIENT_PHASES) + " | "
                     + " | ".join(f"{s[k]:.3f}" for k in SERVER_PHASES) + " |")
    return lines


def cpu_table(rows: list[dict]) -> list[str]:
    """CPU-seconds per group of processes (benchlib.cpu.CpuMeter), where the runs have them: on few cores a sync is
    bound by the engines' CPU work when its CPU-seconds outgrow the broadcast's."""
    if not all("cpu_sync" in x for r in rows for x in r["runs"]):
        return []
    lines = ["CPU-seconds of each repetition's plain broadcast (every process) and of its sync (the engines' process "
             "trees, the trainer's process, the router), median (min–max):", "",
             "| model | replicas | broadcast: all | sync: engines | sync: trainer | sync: router |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        runs = r["runs"]
        lines.append(f"| {r['model']} | {r['replicas']} | {_spread([sum(x['cpu_baseline'].values()) for x in runs])} | "
                     + " | ".join(_spread([x["cpu_sync"][k] for x in runs]) for k in ("engines", "trainer", "router"))
                     + " |")
    return lines + [""]


def attribution(row: dict) -> str:
    """Pure: one line splitting the sync's time into its parts (medians over the repetitions)."""
    runs = row["runs"]
    med = {k: _med([x[k] for x in runs]) for k in ("total", "baseline", *CLIENT_PHASES)}
    trips = _med([x["start_post"] + x["finish_post"] + x["reset_post"] for x in runs])
    slowest = {k: _med([max(srv.get(k, 0.0) for srv in x["server"]) for x in runs]) for k in SERVER_PHASES}
    share = (lambda s: f" ({s / med['total']:.0%})") if med["total"] > 0 else (lambda s: "")
    return (f"**{row['model']}, {row['replicas']} replica{'s' if row['replicas'] > 1 else ''}**: sync "
            f"{med['total']:.3f} s [the plain broadcast of the same bytes: {med['baseline']:.3f} s] = packing "
            f"{med['pack']:.3f} s{share(med['pack'])} and waiting for the wire {med['wire']:.3f} s"
            f"{share(med['wire'])} on the trainer's thread (the wire runs under both) + the last chunk's load and "
            f"/update_weights' return {med['update_tail']:.3f} s{share(med['update_tail'])} + start/finish/reset "
            f"round trips {trips:.3f} s{share(trips)}. In the (slowest) worker: loading {slowest['load']:.3f} s in "
            f"all (unpacking views and vLLM's load_weights, while the next chunk arrives), its relay thread waiting "
            f"for the wire {slowest['recv']:.3f} s, the layerwise reload's start {slowest['start']:.3f} s and "
            f"finish {slowest['finish']:.3f} s.")


# -- the wire alone (weight_sync_wire.py's rows) ----------------------------------------------------------------
def wire_loopback_table(rows: list[dict]) -> list[str]:
    lines = ["| receivers | MB | gloo broadcast s | dualrun stream s | stream / broadcast time | trainer packing s |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        bc, st = [x["broadcast"] for x in r["runs"]], [x["stream"] for x in r["runs"]]
        lines.append(f"| {r['receivers']} | {r['bytes'] / 1e6:.1f} | {_spread(bc)} | {_spread(st)} | "
                     f"{_spread([s / b for s, b in zip(st, bc)])} | {_spread([x['pack_s'] for x in r['runs']])} |")
    return lines


def shaped_rows(rows: list[dict]) -> list[dict]:
    """Pure: per shaped row, its limit (the bytes at the link's rate), the stream's fraction of the rate, its time
    over one receiver's at the same rate, and the verdicts on the targets that apply."""
    one = {r["link"]: _med([x["stream"] for x in r["runs"]]) for r in rows if r["receivers"] == 1}
    out = []
    for r in rows:
        limit = r["bytes"] * 8 / r["rate_bps"]
        stream = [x["stream"] for x in r["runs"]]
        fraction = [limit / s for s in stream]
        fan = _med(stream) / one[r["link"]] if r["link"] in one else None
        verdicts = []
        if r["receivers"] == 1:
            verdicts.append(f"{'PASS' if _med(fraction) >= LINK_TARGET else 'FAIL'} (>= {LINK_TARGET} of the link)")
        if r["receivers"] == 4 and fan is not None:
            verdicts.append(f"{'PASS' if fan <= FAN_TARGET else 'FAIL'} (<= {FAN_TARGET}x of 1 receiver)")
        out.append({**r, "limit": limit, "fraction": fraction, "fan": fan, "verdicts": verdicts})
    return out


def wire_shaped_table(rows: list[dict]) -> list[str]:
    lines = ["| link (each machine) | receivers | MB | limit s (bytes at the link's rate) | dualrun stream s | "
             "stream / link rate | time / 1 receiver's | gloo broadcast s | trainer: packing s | waiting s | "
             "receivers: waiting for the wire s | targets |", "|---|" + "---:|" * 10 + "---|"]
    for r in shaped_rows(rows):
        runs = r["runs"]
        fan = f"{r['fan']:.2f}x" if r["fan"] is not None else "-"
        lines.append(f"| {r['link']} | {r['receivers']} | {r['bytes'] / 1e6:.1f} | {r['limit']:.2f} | "
                     f"{_spread([x['stream'] for x in runs])} | {_spread(r['fraction'])} | {fan} | "
                     f"{_spread([x['broadcast'] for x in runs])} | {_spread([x['pack_s'] for x in runs])} | "
                     f"{_spread([x['send_wait_s'] for x in runs])} | {_spread([x['recv_s'] for x in runs])} | "
                     f"{'; '.join(r['verdicts']) or '-'} |")
    return lines


def wire_cpu_lines(rows: list[dict]) -> list[str]:
    """Pure: where the runs have them, the CPU-seconds of every member during the stream and the broadcast, and the
    cores that kept busy (CPU-seconds over the wall time): near this machine's core count, the cores, not the links,
    set the time."""
    if not rows or not all("stream_cpu_s" in x for r in rows for x in r["runs"]):
        return []
    lines = [f"CPU-seconds of every member (all their threads) during each run, and the cores busy on average "
             f"(CPU-seconds over the run's wall time; this machine has {os.cpu_count()}):", "",
             "| link | receivers | stream CPU-s | stream: cores busy | broadcast CPU-s | broadcast: cores busy |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        runs = r["runs"]
        lines.append(f"| {r['link']} | {r['receivers']} | {_spread([x['stream_cpu_s'] for x in runs])} | "
                     f"{_spread([x['stream_cpu_s'] / x['stream'] for x in runs])} | "
                     f"{_spread([x['broadcast_cpu_s'] for x in runs])} | "
                     f"{_spread([x['broadcast_cpu_s'] / x['broadcast'] for x in runs])} |")
    return lines + [""]


def tree_lines(rows: list[dict]) -> list[str]:
    """Pure: per link rate, gloo's broadcast and dualrun's chain against the number of receivers, as multiples of
    one receiver's time (the tree's copies on the trainer's link show as 1, 2, 3)."""
    out = []
    for link in dict.fromkeys(r["link"] for r in rows):
        these = sorted((r for r in rows if r["link"] == link), key=lambda r: r["receivers"])
        for key, name in (("broadcast", "gloo's broadcast"), ("stream", "dualrun's chain")):
            med = [_med([x[key] for x in r["runs"]]) for r in these]
            said = ", ".join(f"{r['receivers']}: {m:.2f} s ({m / med[0]:.2f}x)" for r, m in zip(these, med))
            out.append(f"- {link}, {name}, receivers {said}")
    return out


# -- the whole report -------------------------------------------------------------------------------------------
def report(rows: list[dict], meta: dict, wire: dict | None = None) -> str:
    loads = [x["load"] for r in rows for x in r["runs"]]
    lines = ["# Weight sync to vLLM CPU replicas over gloo: at the wire's speed, and to four replicas as to one", "",
             f"`{meta['command']}` ({meta['when']}). Load average (1 min) at each repetition "
             f"{min(loads):.1f}–{max(loads):.1f} (median {_med(loads):.1f}), at the end {meta['load_end']}, on "
             f"{os.cpu_count()} cores shared with other engineers' jobs: absolute numbers are inflated and noisy; the "
             "ratios, measured in the same run, are what count. MB = 10^6 bytes, per replica; median (min–max) over "
             "the repetitions.", "",
             "## The full sync on one machine (loopback), against a plain gloo broadcast", "",
             f"Each row: {meta['reps']} repetitions after one untimed sync; each repetition is a plain "
             "torch.distributed gloo broadcast of the same packed chunks (this process to one receiver process per "
             "replica, buffers allocated once at both ends, nothing loaded), timed once the engines rest (1.2 s "
             "after the sync before: a reader still spinning would take the broadcast's cores), immediately "
             "followed by one full sync "
             "(TRL's unchanged `VLLMClient`, dualrun's gloo path, through dualrun's router: `update_named_params` "
             "of every parameter, then `reset_prefix_cache`, as GRPOTrainer's `sync_weights`). The limit: the "
             f"sync's MB/s >= {TARGET} of the broadcast's, in every repetition (PASS), or in the median only "
             "(PASS (median)).", "", *sync_table(rows), "", *landed_lines(rows),
             "### Where the sync's time goes", "",
             "Seconds, median over the repetitions. Trainer side (this process's clock, its one thread): **start**, "
             "**finish**, **reset**: the `/start_weight_update`, `/finish_weight_update`, `/reset_prefix_cache` "
             "round trips through the router; **pack**: copying the small tensors (norms) into their segments in "
             "one of the two reused chunk buffers (a big tensor's segments go from the parameter itself); **wire**: "
             "waiting for a buffer's sends to leave before packing into it again, and for the last sends; **other**: "
             "cutting chunks and posting sends (a send's first bytes may be copied to the socket then); **tail**: "
             "from the last send until `/update_weights` returns (the workers load the "
             "last chunk). Worker side (the slowest replica, benchmarks/benchlib/weight_sync_timing.py): **recv** (the relay "
             "thread waiting for segments; it overlaps **load**), **load** (views of the chunk into vLLM's "
             "`load_weights`, while the next chunk arrives), **relay** (waiting for the segments passed on to the "
             "next replica), **start**/**finish** (vLLM's layerwise reload init / finalize, the CPU repack).", "",
             *phases_table(rows), "", *[f"- {attribution(r)}" for r in rows], "", *cpu_table(rows)]
    wire = wire or {}
    if wire.get("loopback"):
        w = wire["loopback"]
        lines += ["## The wire alone on loopback: gloo's broadcast against dualrun's chain", "",
                  f"`{w['command']}` ({w['when']}; load {_loads(w)}). Plain processes, no vLLM: the trainer's "
                  "Sender (packing included) and relaying Receivers that load nothing, against gloo's broadcast of "
                  "the same packed chunks, both in the same group, alternating which goes first. On one machine every "
                  "hop is a copy on the same 2 cores, so no algorithm can make 4 receivers as fast as 1 here: this "
                  "table says only that the chain costs no more than the tree where the wire is the CPU.", "",
                  *wire_loopback_table(w["rows"]), "", *wire_cpu_lines(w["rows"])]
    if wire.get("shaped"):
        w = wire["shaped"]
        lines += ["## Shaped links: the trainer on machine 0, each receiver on a machine of its own", "",
                  f"`{w['command']}` ({w['when']}; load {_loads(w)}). The wire alone: plain processes on the "
                  "virtual cluster's machines (tests/support/vcluster.py: network namespaces on a bridge), running "
                  "dualrun's wire and stream code (`dualrun.weightsync.stream`: the trainer's Sender, relaying "
                  "Receivers whose `load` does nothing) without vLLM (four vLLM CPU engines do not fit beside the "
                  "other jobs on this machine). Every machine's link is limited with `tc tbf` to the rate, both "
                  "ways. The limit: the "
                  f"model's bytes at the link's rate; targets: 1 receiver >= {LINK_TARGET} of the link's rate, 4 "
                  f"receivers <= {FAN_TARGET}x the time of 1. Beside it, gloo's own broadcast of the same chunks "
                  "(its binomial tree: the trainer's link carries 1, 2, 3 copies for 1, 2, 4 receivers).", "",
                  *wire_shaped_table(w["rows"]), "", *wire_cpu_lines(w["rows"]), *tree_lines(w["rows"]), ""]
    lines += ["## Machine", "", f"- {platform.platform()}, {os.cpu_count()} cores, shared with other engineers' jobs.",
              f"- Python {platform.python_version()}, {meta['versions']}.", ""]
    return "\n".join(lines)


def _loads(wire: dict) -> str:
    loads = [r["load"] for r in wire["rows"]]
    return f"{min(loads):.1f}–{max(loads):.1f} at each layout's start, {wire['load_end']} at the end"


# -- synthetic numbers ------------------------------------------------------------------------------------------
def fake_rows(reps: int) -> list[dict]:
    """Synthetic numbers in the shape `measure_model` returns (for `--fake`: the report without any process)."""
    rows = []
    for name, params, chunks in (("tiny", 0.02e6, 1), ("100M", 101e6, 7)):
        for replicas in (1, 2):
            nbytes = int(params * 4)
            runs = [{"total": 0.05 + nbytes / 4e8 * replicas, "baseline": 0.002 + nbytes / 1e9 * replicas,
                     "load": 10.0 + i, **{k: 0.01 for k in CLIENT_PHASES},
                     "cpu_baseline": {"trainer": 0.1, "receivers": 0.1 * replicas, "engines": 0.0, "router": 0.0},
                     "cpu_sync": {"trainer": 0.1, "receivers": 0.0, "engines": 0.5 * replicas, "router": 0.01},
                     "server": [{k: 0.01 for k in SERVER_PHASES} for _ in range(replicas)]} for i in range(reps)]
            rows.append({"model": name, "params": params, "bytes": nbytes, "chunks": chunks, "replicas": replicas,
                         "runs": runs})
    return rows


def fake_wire(reps: int) -> dict:
    """Synthetic weight_sync_wire.py output: loopback and two shaped rates, 1, 2, 4 receivers."""
    def rows(link: str, rate: float | None, per_s: float) -> list[dict]:
        return [{"link": link, "rate_bps": rate, "load": 9.0, "receivers": n, "bytes": 411_435_008, "chunks": 6,
                 "runs": [{"broadcast": 0.4 * n + i * 0.01, "stream": 411e6 / per_s * (1 + 0.05 * n) + i * 0.01,
                           "pack_s": 0.2, "send_wait_s": 0.1, "recv_s": 0.3, "stream_cpu_s": 0.5 * (n + 1),
                           "broadcast_cpu_s": 0.4 * (n + 1)} for i in range(reps)]}
                for n in (1, 2, 4)]
    meta = {"when": "2026-01-01 00:00 UTC", "load_end": "9.0 / 9.0 / 9.0 (1/5/15 min)"}
    return {"loopback": {**meta, "command": "weight_sync_wire.py --loopback", "rows": rows("loopback", None, 1e9)},
            "shaped": {**meta, "command": "weight_sync_wire.py", "rows": rows("1gbit", 1e9, 1.15e8)
                       + rows("5gbit", 5e9, 5.5e8)}}
