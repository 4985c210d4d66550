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
    kind = BackendKind("torchrun", per_machine=True, ray=False, groups="local", placement=MachinesPlacement)
    output = "output of every rank on this terminal"

    def launcher_class(self) -> "type[Launcher]":
        from dualrun.backends.torchrun.agent_launcher import TorchrunLauncher

        return TorchrunLauncher

    def before_launch(self, cfg: "JobConfig") -> None:
        """Machine 0: main_process_port is free where its store will bind it (a taken one is one line, exit 2)."""
        from dualrun.launchers.rendezvous_port import check_torchrun

        check_torchrun(cfg)

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
