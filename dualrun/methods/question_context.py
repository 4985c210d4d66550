"""What `dualrun config`'s questions offer (dualrun/config/questions.py's `Context`), read from the registries.

Why here, beside the method plugins: the questions read each method's roles from its plugin, which sits above the
config; the questions themselves stay pure records and take this as a value.
"""
from __future__ import annotations

from dualrun.config import engine_kinds, schema
from dualrun.config.backends import DEFAULT, installed, kind_of
from dualrun.config.questions import Context, MethodRoles
from dualrun.methods.plugin import available, get_plugin

FIRST = ("sft", "pt", "grpo", "gkd")   # the order the methods are offered in; others after, by name


def question_context(devices: int | None = None, dist: str = "MULTI_GPU") -> Context:
    """The installed backends (the default first) and methods (a role program's method, started once as a driver,
    has configs of its own: configs/sampling_*.yaml), the engines, and this machine's accelerators (counted as
    `dualrun config default` counts them, unless `devices` is given)."""
    methods = {}
    for name in sorted(available(), key=lambda n: (FIRST.index(n) if n in FIRST else len(FIRST), n)):
        plugin = get_plugin(name)
        if not getattr(plugin, "single_controller", False):
            methods[name] = MethodRoles(name, tuple(plugin.roles), tuple(plugin.colocated_engine_roles),
                                        frozenset(plugin.weight_roles), dict(plugin.role_key_reads))
    backends = (DEFAULT, *(b for b in installed() if b != DEFAULT))
    by_hand = tuple(b for b in backends if kind_of(b).per_machine and any(
        key.name == "gpus_per_machine" for key in schema.SECTIONS.get(b, ())))
    if devices is None:
        from dualrun.config.starter import detected_devices

        devices, dist = detected_devices()
    engines = engine_kinds.names()
    return Context(backends, by_hand, methods, engines,
                   tuple(n for n in engines if engine_kinds.engine_kind(n).parallel),
                   engine_kinds.ON_GPUS.name, engine_kinds.ON_CPUS.name, devices, dist)
