"""torchrun: one launch per machine, like `accelerate launch`; the plan is known before anything starts."""
from __future__ import annotations

from typing import TYPE_CHECKING

from dualrun.backends.base import Backend
from dualrun.config.backends import BackendKind
from dualrun.plan.placement import MachinesPlacement

if TYPE_CHECKING:
    from dualrun.check.preflight import Outcome
    from dualrun.config.model import JobConfig
    from dualrun.launchers.launcher import Launcher


class TorchrunBackend(Backend):
    kind = BackendKind("torchrun", per_machine=True, ray=False, groups="local", placement=MachinesPlacement,
                       fleets=True)
    output = "output of every rank on this terminal"
    section = "torchrun"

    def launcher_class(self) -> "type[Launcher]":
        from dualrun.backends.torchrun.agent_launcher import TorchrunLauncher

        return TorchrunLauncher

    def before_launch(self, cfg: "JobConfig") -> None:
        """Machine 0, which hosts torchrun's store: its port is free where the store binds it (a taken one is one
        line, exit 2; one machine without main_process_port picks a free one; machines 1..N bind nothing)."""
        from dualrun.launchers.rendezvous_port import DEFAULT_PORT, TORCHRUN_STORE, refuse_taken, store_host
        from dualrun.plan.meeting import rendezvous_of

        job = rendezvous_of(cfg)
        port = job.master_port or (DEFAULT_PORT if job.several else None)
        if job.machine_rank == 0 and port is not None:
            refuse_taken(job, port, store_host(not job.several, job.address), TORCHRUN_STORE)

    def check(self, cfg: "JobConfig", wait_s: float | None = None) -> "Outcome":
        """This machine against the plan; on several machines, then the meeting with the others (check_meeting)."""
        from dualrun.check.preflight import check_here, plan_or_problem, this_machine

        if cfg.num_machines <= 1:
            return check_here(cfg)
        from dualrun.backends.torchrun.check_meeting import meet
        from dualrun.backends.torchrun.machine_check import WAIT_S

        problems: list[str] = []
        plan = plan_or_problem(cfg, None, problems)
        node, _ = this_machine(cfg, plan, problems)
        return meet(cfg, plan, node, problems, WAIT_S if wait_s is None else wait_s)


BACKEND = TorchrunBackend()
