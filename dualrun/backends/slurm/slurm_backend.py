"""SLURM: one launch inside an allocation (`salloc`, `sbatch`) starts every node's processes with `srun`; the plan
is the core's `MachinesPlacement` over the allocation's nodes (`roles.<name>.machines` index them)."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Mapping

from dualrun.backends.base import Backend
from dualrun.backends.slurm import options
from dualrun.config.backends import BackendKind
from dualrun.plan.placement import MachinesPlacement

if TYPE_CHECKING:
    from dualrun.check.preflight import Outcome
    from dualrun.config.model import JobConfig
    from dualrun.launchers.launcher import Launcher
    from dualrun.plan.processes import Plan


class SlurmBackend(Backend):
    # per_machine: each machine's share is explicit in the plan (machines, devices, a role's `machines`), as on
    # torchrun; the launcher starts every machine's share itself, through srun
    kind = BackendKind("slurm", per_machine=True, ray=False, groups="local", placement=MachinesPlacement)
    output = "output of every rank on this terminal, through srun"
    section = "slurm"               # `--submit`'s batch script lines (options.py); the plan carries it
    section_keys = options.KEYS

    def check_section(self, source: str, values: Mapping[str, Any]) -> None:
        options.check(source, values)

    def machines_found(self, environ: Mapping[str, str]) -> tuple[int, str] | None:
        """Inside an allocation, an unset num_machines is its node count: `salloc -N 4` and a config without
        num_machines plan 4 nodes."""
        from dualrun.backends.slurm.allocation import job_id, node_count

        count = node_count(environ)
        return None if count is None else (count, f"the {count} node(s) of SLURM job {job_id(environ)}")

    def launcher_class(self) -> "type[Launcher]":
        from dualrun.backends.slurm.srun_launcher import SlurmLauncher

        return SlurmLauncher

    def before_launch(self, cfg: "JobConfig") -> None:
        """Inside an allocation with at least the job's machines (else one line, exit 2; nothing started)."""
        from dualrun.backends.slurm.allocation import current
        from dualrun.contract.errors import LaunchError

        alloc = current(os.environ)
        if cfg.num_machines > len(alloc.nodes):
            raise LaunchError(f"num_machines is {cfg.num_machines} but SLURM job {alloc.job_id} has "
                              f"{len(alloc.nodes)} node(s) ({', '.join(alloc.nodes)}): ask salloc/sbatch for "
                              f"--nodes={cfg.num_machines}, or lower num_machines", 2)
        if cfg.machine_rank:
            raise LaunchError("machine_rank must be 0 or unset on SLURM: one launch starts every node's "
                              "processes with srun", 2)

    def plan_notes(self, cfg: "JobConfig", plan: "Plan") -> list[str]:
        """The srun lines a launch of this plan runs (its dry run's, the training script as SCRIPT)."""
        from dualrun.launchers.launcher import Program

        from dualrun.backends.slurm.allocation import job_id

        launcher = self.launcher(cfg, Program("SCRIPT"), None)
        if cfg.machines_from:
            notes = [f"# num_machines unset: {cfg.machines_from}"]
        elif "num_machines" not in cfg.written and job_id(os.environ) is None:
            notes = ["# num_machines unset and outside an allocation: planned on 1 node (inside salloc or sbatch it "
                     "is the allocation's node count)"]
        else:
            notes = []
        return notes + launcher.describe(launcher.prepare(plan)).splitlines()

    def submit(self, cfg: "JobConfig", command: list[str], dry_run: bool = False) -> int:
        """From a login node: the batch script the plan needs, sbatch, the job's output followed (submit.py)."""
        from dualrun.backends.slurm.submit import submit
        from dualrun.plan.processes import make_plan

        return submit(cfg, make_plan(cfg), command, dry_run, os.environ)

    def check(self, cfg: "JobConfig", wait_s: float | None = None) -> "Outcome":
        from dualrun.backends.slurm.allocation_check import check_nodes

        return check_nodes(cfg)


BACKEND = SlurmBackend()
