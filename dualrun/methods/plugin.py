"""Method plugins, their driver half: which roles a method has, how they are validated and served.

Built-in plugins live in the top-level `plugins/` folder (installed as `dualrun.plugins.<name>`), each with its worker
half (the hooks that wire the trainer) in `plugins/workers/<name>.py`, found by dualrun/rank/method.py, so a worker
imports neither the config nor the servers' command lines. Third-party ones register a `MethodPlugin` subclass (or
instance) under the entry-point group `dualrun.plugins`, and may keep both halves in it (its `activate`).
"""
from __future__ import annotations

import importlib
from typing import Any, Mapping

from dualrun.config.model import JobConfig, RoleSpec
from dualrun.contract.errors import ConfigError
from dualrun.contract.protocol import PLUGIN_ENTRY_POINTS, address_env, api_key_env

ALIASES = {"pt": "sft"}


class MethodPlugin:
    """Base class. Override what the method needs; the defaults describe a single `train` role."""

    name = "base"
    roles: tuple[str, ...] = ("train",)          # roles the method knows
    required_roles: tuple[str, ...] = ("train",)  # roles that must be present
    # roles whose vLLM engine, colocated with the trainers, takes `tensor_parallel_size` and `offload_model`
    colocated_engine_roles: tuple[str, ...] = ()
    # roles whose separate engines take the trainer's weights (where their engine can: `EngineKind.takes_weights`):
    # the plan holds a restarted replica of one out of rotation until its first update, gives its server the
    # engine's `weight_env`, and `dualrun check` rehearses the weight-sync group with its engines
    weight_roles: frozenset[str] = frozenset()
    # role keys the worker half reads beyond dualrun's own reading (dualrun/config/role_reads.py):
    # {role: {key: places}}, places among "trainer", "colocated", "separate", "address"; elsewhere refused
    role_key_reads: Mapping[str, Mapping[str, tuple[str, ...]]] = {}

    # -- driver side (pure) ------------------------------------------------------------------------
    def validate(self, cfg: JobConfig) -> None:
        """Raise ConfigError for layouts this method cannot run."""
        for role in cfg.roles:
            if role.name not in self.roles:
                raise ConfigError(cfg.source, f"roles.{role.name}",
                                  f"a role of method '{cfg.method}' ({', '.join(self.roles)})", role.name)
        for name in self.required_roles:
            if cfg.role(name) is None:
                raise ConfigError(cfg.source, f"roles.{name}", f"a `{name}` role (method '{cfg.method}' needs it)")
        from dualrun.config.fleet import refuse_bounds
        from dualrun.config.refusals import inert_keys, program_sizes
        from dualrun.config.role_reads import unread_role_keys

        single = bool(getattr(self, "single_controller", False))
        inert_keys(cfg, self.colocated_engine_roles, single)
        if single:
            program_sizes(cfg)
        unread_role_keys(cfg, self.colocated_engine_roles, single, self.role_key_reads)
        router_keys(cfg)
        refuse_bounds(cfg)

    def preflight(self, cfg: JobConfig) -> None:
        """Raise ConfigError for what this environment lacks, at launch before anything starts (a dry run and
        `dualrun plan` show the layout without it)."""

    def check_program(self, cfg: JobConfig, program: Any) -> None:
        """Raise ConfigError for what the program (a `Program`: its script or module, read, never run) cannot do
        with this layout; before anything starts, at a dry run too."""

    def server_command(self, cfg: JobConfig, role: RoleSpec, host: str, port: int) -> list[str] | None:
        """argv of the server a separate role runs (None: the method has no server for this role)."""
        return None

    def health_path(self, role: RoleSpec) -> str:
        return "/health/"

    def wiring_env(self, cfg: JobConfig, servers: Mapping[str, str]) -> dict[str, str]:
        """Env for the trainer ranks, given each separate role's `host:port`."""
        from dualrun.contract.redact import api_key_of

        keys = {api_key_env(name): api_key_of(role.server_args) for name in servers
                if (role := cfg.role(name)) is not None and api_key_of(role.server_args)}
        return {**{address_env(name): addr for name, addr in servers.items()}, **keys}

    # -- worker side (a third-party plugin's; a built-in's is plugins/workers/<name>.py) -----------------------
    def activate(self, settings: Mapping[str, Any]) -> None:
        """Install hooks in a worker before the user's script runs (dualrun/rank/method.py calls it)."""


def validate(cfg: JobConfig, plugin: MethodPlugin) -> None:
    """`plugin.validate(cfg)`, its errors naming what the user wrote: a role made from ms-swift's `device_groups`
    by its group's key (README: "An error about a role made from ms-swift's device_groups names the group key")."""
    from dualrun.config.load import errors_as_written

    with errors_as_written(cfg.written_as):
        plugin.validate(cfg)


def router_keys(cfg: JobConfig) -> None:
    """`replica_restarts` restarts replicas behind a router: a separate role with one engine has none, so the key
    would do nothing there."""
    from dualrun.config.fleet import bounds

    for role in cfg.roles:
        if role.replica_restarts in (0, 3) or role.address or not cfg.is_separate(role.name):
            continue
        why = restarts_do_nothing(cfg, role, bounds(cfg, role).high)
        if why:
            raise ConfigError(cfg.source, f"roles.{role.name}.replica_restarts", f"0 or unset ({why}: a dead "
                              "replica ends the job, or restarts it whole with max_failures)", role.replica_restarts)


def restarts_do_nothing(cfg: JobConfig, role: RoleSpec, replicas: int) -> str | None:
    """Why `replica_restarts` would restart nothing for `role` (None: it takes effect; servers/supervision.py)."""
    if replicas == 1:
        return "one engine has no router to take a restarted one back"
    return None


def get_plugin(name: str, source: str = "<config>") -> MethodPlugin:
    """The plugin for `method: name`: built-in module first, then the entry-point group."""
    name = ALIASES.get(name, name)
    if not name.startswith("_"):   # `__init__` and private helpers are modules of the package, not plugins
        try:
            module = importlib.import_module(f"dualrun.plugins.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"dualrun.plugins.{name}":
                raise
        else:
            plugin = getattr(module, "PLUGIN", None)
            if plugin is not None:
                return plugin() if isinstance(plugin, type) else plugin
    from importlib.metadata import entry_points

    for ep in entry_points(group=PLUGIN_ENTRY_POINTS):
        if ep.name == name:
            plugin = ep.load()
            return plugin() if isinstance(plugin, type) else plugin
    raise ConfigError(source, "method", f"one of {', '.join(available())}", name)


def available() -> list[str]:
    import pkgutil

    names = set(ALIASES)
    try:
        import dualrun.plugins as pkg

        names.update(m.name for m in pkgutil.iter_modules(pkg.__path__)   # `workers`: the worker halves
                     if not m.name.startswith("_") and not m.ispkg)
    except ImportError:
        pass
    from importlib.metadata import entry_points

    names.update(ep.name for ep in entry_points(group=PLUGIN_ENTRY_POINTS))
    return sorted(names)

