"""The launch benchmark's outputs: the summary (median, min–max, ratio against bare torchrun), the targets it is
judged by, the Markdown tables, the chart, results/launch.md and the blocks it refreshes in benchmarks/README.md
and the main README. Pure formatting over `measure.Run`s: the same code writes real and fake numbers."""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from . import phases as ph
from .job import BASE, SHORT, VARIANTS
from .measure import Run

# The overhead dualrun allows itself against bare torchrun, as (variant, metric, limit, kind):
# kind "max" -> ratio <= limit, "min" -> ratio >= limit, "cores" -> the median itself <= limit
TARGETS = [
    ("dualrun-torchrun", "wall", 1.05, "max"),
    ("dualrun-ray", "wall", 1.05, "max"),
    ("dualrun-ray-embedded", "wall", 1.5, "max"),
    ("dualrun-torchrun", "steps_per_s", 0.98, "min"),
    ("dualrun-ray", "steps_per_s", 0.98, "min"),
    ("dualrun-ray-embedded", "steps_per_s", 0.98, "min"),
    ("dualrun-ray", "own_cores", 0.05, "cores"),
    ("dualrun-ray-embedded", "own_cores", 0.05, "cores"),
]
README_START, README_END = "<!-- launch-table:start -->", "<!-- launch-table:end -->"


def fmt(x: float | None, digits: int = 2) -> str:
    """A number for a table cell ("-" where it was not measured)."""
    return "-" if x is None else f"{x:.{digits}f}"


def _split(split: dict | None) -> str:
    """' (launcher 0.002, ray actors 0.04, ...)': where the launcher machinery's cores went."""
    if not split:
        return ""
    return " (" + ", ".join(f"{k} {v:.3f}" for k, v in sorted(split.items()) if k != "ranks") + ")"


METRICS = ("wall_s", "first_step_s", "steps_per_s", "steady_steps_per_s", "step_cpu_ms", "machinery_cores",
           "own_cores", "observed_steps_per_s", "driver_rss_mib", "driver_cpu_s")


def summarize(runs: list[Run], variants: list[str]) -> dict[str, dict]:
    """Per variant: its successful runs' median, min and max of every metric, and the ratio of medians against
    bare torchrun."""
    out = {}
    for v in variants:
        ok = [r for r in runs if r.variant == v and r.ok]
        s: dict = {"n": len(ok), "failed": sum(1 for r in runs if r.variant == v and not r.ok)}
        for m in METRICS:
            vals = [getattr(r, m) for r in ok if getattr(r, m) is not None]
            s[m] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)} if vals else None
        s["train_loss"] = sorted({r.train_loss for r in ok if r.train_loss})
        out[v] = s
    base = out.get(BASE)
    for v, s in out.items():
        s["ratio"] = {}
        for m in METRICS:
            if base and base.get(m) and s.get(m) and base[m]["median"]:
                s["ratio"][m] = s[m]["median"] / base[m]["median"]
    return out


def targets(summary: dict[str, dict]) -> list[dict]:
    """Each of TARGETS with its measured ratio and whether it holds (None: the variant did not run)."""
    metric = {"wall": "wall_s", "steps_per_s": "steady_steps_per_s"}
    out = []
    for v, m, limit, kind in TARGETS:
        if kind == "cores":
            ratio = (summary.get(v, {}).get(m) or {}).get("median")   # an amount of cores, not a ratio
        else:
            ratio = summary.get(v, {}).get("ratio", {}).get(metric[m])
        ok = None if ratio is None else (ratio >= limit if kind == "min" else ratio <= limit)
        out.append({"variant": v, "metric": m, "limit": limit, "kind": kind, "ratio": ratio, "pass": ok})
    return out


def _cell(s: dict, m: str, digits: int = 2) -> str:
    v = s.get(m)
    if not v:
        return "-"
    return f"{v['median']:.{digits}f} ({v['min']:.{digits}f}–{v['max']:.{digits}f})"


def _ratio(s: dict, m: str) -> str:
    r = s.get("ratio", {}).get(m)
    return "-" if r is None else f"{r:.2f}x"


def table(summary: dict[str, dict]) -> str:
    """The headline table: one row per launcher."""
    head = ("| launcher | n | wall s | ×bare | first step s | ×bare | steps/s (steady, in ranks) | ×bare | "
            "CPU ms per step | launcher CPU while training (cores) | steps/s (trainer) | steps/s (seen by driver) | "
            "driver peak RSS MiB | driver CPU s |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    rows = []
    for v, s in summary.items():
        n = f"{s['n']}" + (f" (+{s['failed']} failed)" if s["failed"] else "")
        rows.append(f"| {VARIANTS[v][0]} | {n} | {_cell(s, 'wall_s', 1)} | {_ratio(s, 'wall_s')} | "
                    f"{_cell(s, 'first_step_s', 1)} | {_ratio(s, 'first_step_s')} | "
                    f"{_cell(s, 'steady_steps_per_s', 1)} | {_ratio(s, 'steady_steps_per_s')} | "
                    f"{_cell(s, 'step_cpu_ms', 1)} | {_cell(s, 'machinery_cores', 3)} | {_cell(s, 'steps_per_s', 1)} | "
                    f"{_cell(s, 'observed_steps_per_s', 1)} | "
                    f"{_cell(s, 'driver_rss_mib', 0)} | {_cell(s, 'driver_cpu_s', 1)} |")
    return head + "\n".join(rows) + "\n\nEach cell: median (min–max) over the repetitions; ×bare: ratio of medians."


def phases_md(runs: list[Run], variants: list[str]) -> str:
    """Seconds after the launcher's spawn at which each phase was reached (median, min–max), and the step from the
    previous phase: where each launcher's seconds go."""
    names = [n for n, _ in ph.PHASES]
    out = ["| launcher | " + " | ".join(n.replace("_", " ") for n in names) + " |", "|---|" + "---:|" * len(names)]
    for v in variants:
        got = [r.phases for r in runs if r.variant == v and r.ok and r.phases]
        cells = []
        for n in names:
            vals = [p[n] for p in got if p.get(n) is not None]
            cells.append(f"{statistics.median(vals):.2f} ({min(vals):.2f}–{max(vals):.2f})" if vals else "-")
        out.append(f"| {VARIANTS[v][0]} | " + " | ".join(cells) + " |")
    out += ["", "Seconds after the launcher was spawned (median, min–max over the repetitions) at which the last rank "
            "reached each phase: " + "; ".join(f"**{n.replace('_', ' ')}**: {d}" for n, d in ph.PHASES) + ". "
            "Recorded inside the ranks by benchmarks/probe/ (time.time(), one clock with the driver's)."]
    return "\n".join(out)


def targets_md(tg: list[dict]) -> str:
    """The targets as a table: limit, measured ratio, PASS/FAIL."""
    out = ["| target | measured | result |", "|---|---:|---|"]
    for t in tg:
        op = ">=" if t["kind"] == "min" else "<="
        res = "not run" if t["pass"] is None else ("PASS" if t["pass"] else "FAIL")
        if t["kind"] == "cores":
            meas = "-" if t["ratio"] is None else f"{t['ratio']:.3f}"
            whose = ("driver + rank actors (the running cluster's daemons are its own)" if t["variant"] == "dualrun-ray"
                     else "driver + rank actors + the cluster it started")
            out.append(f"| {VARIANTS[t['variant']][0]}: CPU while training, {whose} {op} {t['limit']:g} cores "
                       f"| {meas} | {res} |")
            continue
        what = "wall time" if t["metric"] == "wall" else "steps/s (steady, in ranks)"
        meas = "-" if t["ratio"] is None else f"{t['ratio']:.3f}x"
        out.append(f"| {VARIANTS[t['variant']][0]}: {what} {op} {t['limit']:g}x bare torchrun | {meas} | {res} |")
    return "\n".join(out)


def machine_md(info: dict) -> str:
    """The machine and its load, as a list: what a reader needs to judge the numbers above."""
    lb = info.get("load_before")
    la = info.get("load_after")
    loads = lambda x: "-" if not x else " / ".join(f"{v:.2f}" for v in x)  # noqa: E731
    return "\n".join([
        f"- CPU: {info.get('cpus')} cores ({info.get('cpu', '?')}); memory {info.get('mem_total_gib', '?')} GiB "
        f"({info.get('mem_available_gib', '?')} GiB available at start); {info.get('platform', '?')}",
        f"- load average (1/5/15 min) before: {loads(lb)}; after: {loads(la)} (other jobs share this machine); "
        f"cores kept busy by others in the second before each run: {info.get('busy', '-')}",
        f"- Python {info.get('python')}, torch {info.get('torch')}, transformers {info.get('transformers')}, "
        f"trl {info.get('trl')}, accelerate {info.get('accelerate')}, datasets {info.get('datasets')}, "
        f"ray {info.get('ray')}, dualrun {info.get('dualrun')} (git {info.get('git', '?')})",
        f"- job: examples/sft.py, tiny model (examples/make_tiny_model.py), {info.get('nproc')} processes, gloo, "
        f"{info.get('steps')} steps, logging every step, no checkpoints; {info.get('reps')} repetitions, "
        f"session {info.get('session_s', '?')} s; running cluster start-ups: {info.get('cluster_start_s', '-')} s, "
        f"cores the idle cluster's own processes keep busy (5 s after start-up): {info.get('cluster_idle_cores', '-')}",
    ])


def runs_md(runs: list[Run]) -> str:
    """Every run, one row each, in the order they ran within a repetition."""
    out = ["| rep | launcher | ok | wall s | first step s | steady steps/s | CPU ms/step | launcher cores | "
           "trainer steps/s | seen steps/s | RSS MiB | CPU s | load 1m | busy cores before | threads in the ranks | "
           "train_loss |", "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in sorted(runs, key=lambda r: (r.rep, list(VARIANTS).index(r.variant))):
        ok = "yes" if r.ok else f"no: {r.error}"
        out.append(f"| {r.rep + 1} | {r.variant} | {ok} | {fmt(r.wall_s)} | {fmt(r.first_step_s)} | "
                   f"{fmt(r.steady_steps_per_s)} | {fmt(r.step_cpu_ms)} | {fmt(r.machinery_cores, 3)}"
                   f"{_split(r.machinery_split)} | "
                   f"{fmt(r.steps_per_s)} | {fmt(r.observed_steps_per_s)} | {fmt(r.driver_rss_mib, 0)} | "
                   f"{fmt(r.driver_cpu_s)} | {fmt(r.load_1m)} | {fmt(r.busy_before)} | {r.threads or '-'} | "
                   f"{r.train_loss or '-'} |")
    return "\n".join(out)


def chart(summary: dict[str, dict], path: Path, title: str) -> bool:
    """results/launch.png (wall time, steady steps/s, driver RSS); False where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("launch_bench: matplotlib is not installed (pip install matplotlib): no chart", file=sys.stderr)
        return False
    names = [v for v in summary if summary[v].get("wall_s")]
    labels = [SHORT[v] for v in names]
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.2))
    x = range(len(names))
    colors = ["#7f7f7f", "#1f77b4", "#ff7f0e", "#2ca02c", "#98df8a"][: len(names)]

    def bars(ax, metric, ylabel, ratio=True):
        med = [summary[v][metric]["median"] if summary[v].get(metric) else 0 for v in names]
        lo = [m - (summary[v][metric]["min"] if summary[v].get(metric) else 0) for v, m in zip(names, med)]
        hi = [(summary[v][metric]["max"] if summary[v].get(metric) else 0) - m for v, m in zip(names, med)]
        ax.bar(x, med, yerr=[lo, hi], capsize=4, color=colors)
        if ratio:
            for i, v in enumerate(names):
                r = summary[v]["ratio"].get(metric)
                if r is not None:
                    ax.text(i, med[i] + hi[i], f"{r:.2f}x", ha="center", va="bottom", fontsize=9)
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, fontsize=8.5)
        ax.set_ylabel(ylabel)
        return med

    bars(axes[0], "wall_s", "seconds")
    first = [summary[v]["first_step_s"]["median"] if summary[v].get("first_step_s") else 0 for v in names]
    axes[0].scatter(list(x), first, marker="_", s=900, color="black", zorder=3, label="first training step")
    axes[0].legend(fontsize=8, loc="upper left")
    axes[0].set_title("wall time (median, min–max) and time to first step")
    bars(axes[1], "steady_steps_per_s", "steps / s")
    axes[1].set_title("steady-state steps/s (inside the ranks)")
    bars(axes[2], "driver_rss_mib", "MiB")
    axes[2].set_title("peak RSS of the launcher process")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_launch(runs: list[Run], info: dict, variants: list[str], out_dir: Path, command_line: str,
                 readme: Path | None, fake: bool, main_readme: Path | None = None) -> str:
    """results/launch.md and the chart; the table block of `readme` (benchmarks/README.md) and the targets of
    `main_readme` (the front page keeps only the targets)."""
    summary = summarize(runs, variants)
    tg = targets(summary)
    title = (f"launch benchmark: tiny SFT, {info.get('nproc')} processes, {info.get('steps')} steps, "
             f"{info.get('reps')} reps, {info.get('cpus')} CPUs" + (" — FAKE NUMBERS" if fake else ""))
    has_chart = chart(summary, out_dir / "launch.png", title)
    body = table(summary)
    md = [f"# Launch benchmark{' (FAKE NUMBERS, test output)' if fake else ''}", "",
          f"Command: `{command_line}` — written {time.strftime('%Y-%m-%d %H:%M')}", "", body, "",
          "## Targets", "", targets_md(tg), "", "## Wall time by phase", "", phases_md(runs, variants), "",
          "## Machine", "", machine_md(info), ""]
    if has_chart:
        md += ["![launch benchmark](launch.png)", ""]
    md += ["## Every run (in the order they ran within a repetition, see benchmarks/README.md)", "", runs_md(runs), ""]
    (out_dir / "launch.md").write_text("\n".join(md))
    if readme is not None or main_readme is not None:
        lb_ = info.get("load_before") or ()
        _refresh(readme, f"{body}\n\n{targets_md(tg)}\n\n{phases_md(runs, variants)}\n\n{machine_md(info)}")
        _refresh(main_readme, (
            f"Latest `{command_line}`: tiny SFT, {info.get('nproc')} CPU processes, {info.get('steps')} steps, "
            f"{info.get('cpus')}-core machine shared with other jobs, load average {' / '.join(f'{x:.1f}' for x in lb_)} "
            f"before the run; median of {info.get('reps')} interleaved repetitions against bare torchrun. Every "
            "launcher's numbers: [benchmarks/results/launch.md](benchmarks/results/launch.md); how to rerun: "
            f"[benchmarks/README.md](benchmarks/README.md){_noise_note(info)}:\n\n{targets_md(tg)}"))
    return body + "\n\n" + targets_md(tg)


def _noise_note(info: dict) -> str:
    """A warning when other jobs kept more processes runnable than there are cores: the ratios are then noise."""
    load = (info.get("load_before") or (0.0,))[0]
    if load > (info.get("cpus") or 1):
        return (f". **The load average ({load:.0f}) exceeded the {info.get('cpus')} cores: every ratio and PASS/FAIL "
                "below is within the noise; only the CPU columns (CPU ms per step, launcher CPU while training) are "
                "meaningful. Rerun on a quiet machine.**")
    return ""


def _refresh(path: Path | None, block: str) -> None:
    """Replace what lies between the launch-table markers of `path` (nothing when it has none)."""
    if path is None or not path.exists():
        return
    text = path.read_text()
    if README_START in text and README_END in text:
        pre, rest = text.split(README_START, 1)
        path.write_text(f"{pre}{README_START}\n{block}\n{README_END}{rest.split(README_END, 1)[1]}")

