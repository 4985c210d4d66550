"""What a launch asks of a backend (Ray Train's `Backend` and TorchX's schedulers have the same shape: a few
hooks around one launch, the backend's name nowhere else)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Mapping

from dualrun.config.backends import BackendKind
from dualrun.config.backends import backend_object as backend_of_name

if TYPE_CHECKING:
    from dualrun.check.preflight import Outcome
    from dualrun.config.model import JobConfig
    from dualrun.launchers.launcher import Launcher, Program
    from dualrun.plan.processes import Cluster, Plan


class Backend(ABC):
    """One backend. `kind`: what it is like (config/backends.py). `output`: where the ranks' output goes, for the
    launch's first lines. `plans_live`: a launch plans onto the live cluster it joins (else onto the cluster the
    config implies, known before anything starts). `section`: its own config section, which the plan carries to its
    launcher (`plan.rendezvous.options`)."""

    kind: BackendKind
    output: str
    plans_live: bool = False
    section: str | None = None   # the config section its launcher reads (`torchrun`, `ray`), in plan.rendezvous
    # the keys of `section` when the backend owns it (a plug-in's: the core's schema holds only `ray` and `torchrun`):
    # the config checks them as its own (`config/schema.py` `Key`s) and the plan carries the values
    section_keys: tuple = ()

    @property
    def name(self) -> str:
        return self.kind.name

    @abstractmethod
    def launcher_class(self) -> "type[Launcher]":
        """Its launcher (imported only now: Ray's imports Ray). The launcher starts the job's server set
        (`Launcher.server_set`) and its workers."""

    def launcher(self, cfg: "JobConfig", program: "Program", plugin: Any,
                 accelerate_env: dict[str, str] | None = None) -> "Launcher":
        return self.launcher_class()(cfg, program, accelerate_env, plugin=plugin)

    def plan_cluster(self, cfg: "JobConfig") -> "Cluster | None":
        """The live cluster `dualrun plan` places onto (None: the one the config implies)."""
        return None

    def check_section(self, source: str, values: Mapping[str, Any]) -> None:
        """Its own checks of its section's values, once each key has its type (a ConfigError: one line, exit 2);
        run wherever the file has the section, whichever backend the job runs on."""

    def machines_found(self, environ: Mapping[str, str]) -> tuple[int, str] | None:
        """The machines a job gets from where it is launched, when the config leaves `num_machines` unset (a
        scheduler's allocation): (count, what they are, for the lines that name them); None: one machine."""
        return None

    def plan_notes(self, cfg: "JobConfig", plan: "Plan") -> list[str]:
        """Lines `dualrun plan` prints under the plan's table: what this backend would run for it (none by
        default; the launch's `--dry_run` shows the commands of every backend)."""
        return []

    def before_launch(self, cfg: "JobConfig") -> None:
        """What must hold before anything heavy starts (a ConfigError for what does not)."""

    def env_line(self) -> str | None:
        """Its line in `dualrun env` (None: none)."""
        return None

    def groups_mode(self) -> Any:
        """How a role program's worker groups run on this backend (role_programs/modes.py `GroupsMode`): by default the
        driver's own child processes, on the devices the plan gives each role on this machine."""
        from dualrun.role_programs.modes import LOCAL_GROUPS

        return LOCAL_GROUPS

    def submit(self, cfg: "JobConfig", command: list[str], dry_run: bool = False) -> int:
        """`dualrun launch --submit`: hand the job to the backend's batch scheduler, to run `command` (this same
        launch, without `--submit`) where the scheduler places it; follow it and return its exit code (`dry_run`:
        print what would be submitted). A backend without a scheduler refuses it with one line."""
        from dualrun.config.backends import installed
        from dualrun.contract.errors import ConfigError

        with_one = [n for n in installed() if type(backend_of_name(n)).submit is not Backend.submit]
        raise ConfigError("<command line>", "--submit", "a backend with a batch scheduler to submit to ("
                          + (", ".join(with_one) or "none is installed") + ")", f"--backend {self.name}")

    @abstractmethod
    def check(self, cfg: "JobConfig", wait_s: float | None = None) -> "Outcome":
        """`dualrun check`'s look at the nodes the job would run on: (problems, nodes, notes)."""
