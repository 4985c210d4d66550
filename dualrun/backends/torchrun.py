"""torchrun: one launch per machine, like `accelerate launch`; the plan is known before anything starts."""
from __future__ import annotations

from typing import TYPE_CHECKING

from dualrun.backends.base import Backend
from dualrun.config.backends import TORCHRUN

if TYPE_CHECKING:
    from dualrun.check.preflight import Outcome
    from dualrun.config.model import JobConfig
    from dualrun.launchers.base import Launcher


class TorchrunBackend(Backend):
    kind = TORCHRUN
    output = "output of every rank on this terminal"

    def launcher_class(self) -> "type[Launcher]":
        from dualrun.launchers.torchrun import TorchrunLauncher

        return TorchrunLauncher

    def before_launch(self, cfg: "JobConfig") -> None:
        """Machine 0: main_process_port is free where its store will bind it (a taken one is one line, exit 2)."""
        from dualrun.launchers.rendezvous_port import check_torchrun

        check_torchrun(cfg)

    def check(self, cfg: "JobConfig", wait_s: float | None = None) -> "Outcome":
        from dualrun.check.preflight import check_torchrun

        return check_torchrun(cfg, wait_s)
