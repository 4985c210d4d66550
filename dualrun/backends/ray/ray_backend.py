"""Ray: one command on any machine that reaches the cluster; the plan places onto the live cluster it joins (or
the embedded one it starts)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dualrun.backends.base import Backend
from dualrun.backends.ray.packing import RayPlacement
from dualrun.config.backends import BackendKind

if TYPE_CHECKING:
    from dualrun.check.preflight import Outcome
    from dualrun.config.model import JobConfig
    from dualrun.launchers.launcher import Launcher, Program
    from dualrun.plan.processes import Cluster


class RayBackend(Backend):
    kind = BackendKind("ray", per_machine=False, ray=True, groups="ray", placement=RayPlacement, fleets=True)
    output = "output prefixed per rank"
    section = "ray"
    plans_live = True

    def launcher_class(self) -> "type[Launcher]":
        from dualrun.backends.ray.actor_launcher import RayLauncher

        return RayLauncher

    def launcher(self, cfg: "JobConfig", program: "Program", plugin: Any,
                 accelerate_env: dict[str, str] | None = None) -> "Launcher":
        """Ray's launcher, told how many CPUs an embedded cluster declares (every actor of the plan at once)."""
        import functools

        from dualrun.backends.ray.bundles import embedded_cpus
        from dualrun.plan.meeting import rendezvous_of

        return self.launcher_class()(rendezvous_of(cfg), program, accelerate_env, plugin=plugin,
                                     embedded_cpus=functools.partial(embedded_cpus, cfg))

    def plan_cluster(self, cfg: "JobConfig") -> "Cluster | None":
        """The running cluster's nodes when one answers (an address that names one must)."""
        from dualrun.contract.errors import ConfigError
        from dualrun.backends.ray.cluster import live_cluster

        cluster = live_cluster(cfg.ray, cfg.source)
        if cluster is None and cfg.ray.address not in (None, "auto", "local"):
            raise ConfigError(cfg.source, "ray.address", "a Ray cluster reachable from here (checked for 2 s)",
                              cfg.ray.address)
        return cluster

    def before_launch(self, cfg: "JobConfig") -> None:
        """An address given in the config or RAY_ADDRESS answers (about 2 s for a wrong one)."""
        from dualrun.backends.ray.cluster import check_reachable

        check_reachable(cfg.ray.address, cfg.source)

    def env_line(self) -> str | None:
        """Whether a Ray cluster is reachable from here."""
        from dualrun.env.installed import version

        if version("ray") is None:
            return 'ray cluster reachable: no (ray not installed: pip install "ray[default]")'
        from dualrun.backends.ray.connect import reachable_line

        return f"ray cluster reachable: {reachable_line()}"

    def groups_mode(self) -> Any:
        """Each worker a Ray actor in its unit's placement group."""
        from dualrun.backends.ray.actor_groups import RAY_GROUPS

        return RAY_GROUPS

    def check(self, cfg: "JobConfig", wait_s: float | None = None) -> "Outcome":
        from dualrun.backends.ray.node_check import check_ray

        return check_ray(cfg)


BACKEND = RayBackend()
