"""The command-line options the launch-style benchmarks share (startup_bench.py, launch_bench.py): their names,
types and help in one place; each script gives its own defaults and adds the options only it has."""
from __future__ import annotations

import argparse
from typing import Sequence


def add_run_options(p: argparse.ArgumentParser, *, variants: Sequence[str], steps: int, steps_help: str,
                    quiet_cores: float, quick_help: str, fake_help: str) -> None:
    """--reps, --steps, --nproc, --variants, --timeout, --quiet-cores, --quiet-wait, --keep-logs, --fake, --quick."""
    p.add_argument("--reps", type=int, default=5, help="repetitions of every variant (round-robin)")
    p.add_argument("--steps", type=int, default=steps, help=steps_help)
    p.add_argument("--nproc", type=int, default=2, help="training processes per run")
    p.add_argument("--variants", default=",".join(variants), help=f"comma-separated subset of {', '.join(variants)}")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before one run is killed")
    p.add_argument("--quiet-cores", type=float, default=quiet_cores,
                   help="before each run, wait until other jobs keep fewer than this many cores busy ...")
    p.add_argument("--quiet-wait", type=float, default=0.0,
                   help="... for at most this many seconds (default 0: only measure and report it)")
    p.add_argument("--keep-logs", default=None, metavar="DIR", help="keep every run's timestamped output here")
    p.add_argument("--fake", action="store_true", help=fake_help)
    p.add_argument("--quick", action="store_true", help=quick_help)


def chosen_variants(p: argparse.ArgumentParser, given: str, variants: Sequence[str]) -> list[str]:
    """`--variants` as a list, in the order given; an unknown or empty choice ends with argparse's usage error."""
    chosen = [v.strip() for v in given.split(",") if v.strip()]
    unknown = [v for v in chosen if v not in variants]
    if unknown or not chosen:
        p.error(f"unknown variant(s) {unknown}: choose from {', '.join(variants)}")
    return chosen
