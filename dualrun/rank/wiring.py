"""Fill a trainer config's fields the user left at their defaults (in the worker, before the trainer reads them).

Why patch `__post_init__`: TRL's configs are dataclasses that validate (and derive fields) in `__post_init__`;
values set just before it behave exactly as if the user had passed them. A field counts as set by the user
when its value differs from the default, when it was passed by name to the config directly, or when it was
named on the command line (`--vllm_mode ...`): parsers such as HfArgumentParser pass every field, so for them
only the command line tells an explicit default from a left-alone one.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any, Callable, Mapping


_EXPLICIT = "_dualrun_explicit_fields"


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


def on_command_line(name: str, argv: list[str] | None = None) -> bool:
    argv = sys.argv[1:] if argv is None else argv
    flags = {f"--{name}", f"--{name.replace('_', '-')}"}
    return any(a in flags or a.split("=", 1)[0] in flags for a in argv)


def left_at_default(obj: Any, name: str) -> bool:
    fields = {f.name: f for f in dataclasses.fields(obj)}
    if name not in fields:
        return False
    if getattr(obj, name, dataclasses.MISSING) != _default(fields[name]):
        return False
    return name not in getattr(obj, _EXPLICIT, ()) and not on_command_line(name)


def fill_defaults(cls: type, values: Mapping[str, Any] | Callable[[Any], Mapping[str, Any]],
                  announce: Callable[[Any, dict[str, Any]], None] | None = None) -> None:
    """Before `cls.__post_init__` runs, set each of `values` the user left at its default.

    `values` may be a function of the config (e.g. fill `loss_top_k` only when `beta == 0`). Idempotent per class."""
    if getattr(cls, "_dualrun_filled", None) is cls:
        return
    init, post = cls.__init__, getattr(cls, "__post_init__", None)
    init_names = {f.name for f in dataclasses.fields(cls) if f.init}

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        parser_style = init_names <= set(kwargs)   # HfArgumentParser passes every field
        if not parser_style:
            object.__setattr__(self, _EXPLICIT, frozenset(kwargs))
        init(self, *args, **kwargs)

    def __post_init__(self, *args: Any, **kwargs: Any) -> None:
        wanted = values(self) if callable(values) else values
        filled = {}
        for name, value in wanted.items():
            if left_at_default(self, name):
                setattr(self, name, value)
                filled[name] = value
        if filled and announce is not None:
            announce(self, filled)
        if post is not None:
            post(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[method-assign]
    cls.__post_init__ = __post_init__  # type: ignore[attr-defined]
    cls._dualrun_filled = cls  # type: ignore[attr-defined]


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def rollout_fields(address: str, group_port: str | None = None) -> dict[str, Any]:
    """A trainer with a separate rollout server: TRL's vLLM server mode pointed at it, on a free weight-sync port."""
    host, port = split_address(address)
    fields: dict[str, Any] = {"use_vllm": True, "vllm_mode": "server", "vllm_server_host": host,
                              "vllm_server_port": port}
    if group_port:
        fields["vllm_group_port"] = int(group_port)
    return fields


def say(message: str) -> None:
    """One line on rank 0's stderr (every rank would repeat it)."""
    import os

    if os.environ.get("RANK", "0") == "0":
        print(f"dualrun: {message}", file=sys.stderr, flush=True)
