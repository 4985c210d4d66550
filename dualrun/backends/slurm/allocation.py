"""The allocation a launch runs in, read from SLURM's own variables: its job id and its nodes, in SLURM's order.

Why a module of its own: the plan's machine indices (`roles.<name>.machines`) are indices into this list, the
first node is the ranks' MASTER_ADDR, and `dualrun check` looks at the same nodes; only `hostnames` runs a
command (`scontrol show hostnames`, which expands `node[01-04,07]` as SLURM does)."""
from __future__ import annotations

import subprocess
from dataclasses import dataclass
from typing import Mapping

from dualrun.contract.errors import LaunchError

OUTSIDE = ("not inside a SLURM allocation (SLURM_JOB_ID is unset): run it under `salloc` or in an `sbatch` "
           "script, or add --submit to have dualrun write and submit the batch script")


@dataclass(frozen=True)
class Allocation:
    """`job_id`: SLURM_JOB_ID. `nodes`: host names in allocation order (node k is the plan's machine k)."""

    job_id: str
    nodes: tuple[str, ...]

    @property
    def head(self) -> str:
        """The first node: the ranks' MASTER_ADDR and where the routers run."""
        return self.nodes[0]


def job_id(environ: Mapping[str, str]) -> str | None:
    """The allocation's id, None outside one (a login node)."""
    return environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID") or None


def node_count(environ: Mapping[str, str]) -> int | None:
    """How many nodes the allocation holds (SLURM_JOB_NUM_NODES, as salloc and sbatch set it; an older SLURM's
    SLURM_NNODES); None outside one, or where SLURM said nothing readable."""
    if job_id(environ) is None:
        return None
    raw = (environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES") or "").strip()
    return int(raw) if raw.isdigit() and 0 < int(raw) <= 1_000_000 else None


def parse_hostnames(text: str) -> tuple[str, ...]:
    """`scontrol show hostnames`'s output: one name a line, blank lines dropped."""
    return tuple(line.strip() for line in text.splitlines() if line.strip())


def hostnames(nodelist: str) -> tuple[str, ...]:
    """`node[01-02],gpu7` -> its host names, as SLURM expands them."""
    try:
        done = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LaunchError(f"could not expand the allocation's node list {nodelist!r} with scontrol: {e}", 2) from None
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise LaunchError(f"scontrol show hostnames {nodelist} failed: {why}", 2)
    return parse_hostnames(done.stdout)


def current(environ: Mapping[str, str]) -> Allocation:
    """The allocation this process runs in; a LaunchError (exit 2, one line) outside one."""
    jid = job_id(environ)
    if jid is None:
        raise LaunchError(OUTSIDE, 2)
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        raise LaunchError(f"SLURM job {jid}: SLURM_JOB_NODELIST is unset (not started by salloc or sbatch?)", 2)
    nodes = hostnames(nodelist)
    if not nodes:
        raise LaunchError(f"SLURM job {jid}: its node list {nodelist!r} names no host", 2)
    return Allocation(jid, nodes)
