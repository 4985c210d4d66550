"""(helper of weight_sync_bench.py) results/weight_sync.png: left, the full sync's MB/s over the plain gloo
broadcast's on loopback, every repetition, against the 0.9 limit; right, the wire alone on shaped links: seconds per
sync of the ~100M model against the number of receivers, dualrun's chain and gloo's broadcast, with the limit (the
model's bytes at the link's rate) as a dashed line."""
from __future__ import annotations

import sys
from pathlib import Path

from benchlib.weight_sync_report import LINK_TARGET, TARGET, sync_ratios


def chart(rows: list[dict], wire: dict | None, path: Path) -> bool:
    """Draw the chart; False where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("weight_sync_bench: matplotlib is not installed (pip install matplotlib): no chart", file=sys.stderr)
        return False
    shaped = (wire or {}).get("shaped", {}).get("rows", [])
    fig, axes = plt.subplots(1, 2 if shaped else 1, figsize=(13 if shaped else 6.5, 4.8), squeeze=False)
    ax = axes[0][0]
    big = [r for r in rows if r["model"] != "tiny"] or rows
    for i, r in enumerate(big):
        ratios = sync_ratios(r)
        ax.scatter([i] * len(ratios), ratios, color="tab:blue", alpha=0.6)
        ax.hlines(sorted(ratios)[len(ratios) // 2], i - 0.2, i + 0.2, color="tab:blue")
    ax.axhline(TARGET, color="tab:red", linestyle="--", label=f"limit: {TARGET} of the plain broadcast")
    ax.set_xticks(range(len(big)), [f"{r['model']}\n{r['replicas']} replica{'s' * (r['replicas'] > 1)}"
                                    for r in big])
    ax.set_ylim(0, max(1.2, max(max(sync_ratios(r)) for r in big) * 1.1))
    ax.set_ylabel("sync MB/s / plain gloo broadcast MB/s")
    ax.set_title("Full sync to vLLM CPU replicas, loopback\n(every repetition; bar: median)")
    ax.legend(loc="lower right")
    if shaped:
        ax = axes[0][1]
        for n, (link, color) in enumerate(zip(sorted({r["link"] for r in shaped}, key=_bits), ("tab:green",
                                                                                               "tab:purple"))):
            these = sorted((r for r in shaped if r["link"] == link), key=lambda r: r["receivers"])
            xs = [r["receivers"] for r in these]
            med = lambda key, r: sorted(x[key] for x in r["runs"])[len(r["runs"]) // 2]  # noqa: E731
            ax.plot(xs, [med("stream", r) for r in these], "o-", color=color, label=f"dualrun chain, {link}")
            ax.plot(xs, [med("broadcast", r) for r in these], "s:", color=color, alpha=0.7,
                    label=f"gloo broadcast, {link}")
            limit = these[0]["bytes"] * 8 / these[0]["rate_bps"]
            ax.axhline(limit, color=color, linestyle="--", linewidth=0.8)
            ax.axhline(limit / LINK_TARGET, color=color, linestyle="-.", linewidth=0.6)
        ax.set_xticks([1, 2, 4])
        ax.set_xlabel("receivers (one machine each)")
        ax.set_ylabel("seconds per sync of the ~100M model")
        ax.set_title("The wire alone, every link tbf-shaped\n(dashed: bytes at the link's rate; dash-dot: "
                     f"{LINK_TARGET} of it)")
        ax.set_ylim(0, None)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _bits(rate: str) -> float:
    for unit, scale in (("kbit", 1e3), ("mbit", 1e6), ("gbit", 1e9)):
        if rate.endswith(unit):
            return float(rate[:-len(unit)]) * scale
    return 0.0
