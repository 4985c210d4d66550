"""The variables a user sets for dualrun itself, checked like config keys before anything starts.

Why: each was read where it is used (a worker, the exit watchdog, the forwarder) and a bad value was silently taken
as the default there, or failed late on another node. The table of names and what each expects is
`dualrun.config.schema.ENV_VARS` (rendered into docs/config-reference.md).
"""
from __future__ import annotations

import math
import os
import re
from typing import Mapping

from dualrun.config.backends import kind_of
from dualrun.contract import protocol
from dualrun.config.cross_keys import host_port
from dualrun.config.schema import (ACCELERATE_ENV_FLAGS, ACCELERATE_ENV_INTS, MAX_SECONDS, MIN_JOB_TOKEN_CHARS,
                                   MIN_TIMEOUT_S, TRUTH_VALUES)
from dualrun.env.worker import forward_patterns
from dualrun.contract.errors import ConfigError, Said
from dualrun.light.progress import MODES

SOURCE = "<environment>"
_NAME_OR_PATTERN = re.compile(r"[A-Za-z_*?][A-Za-z0-9_*?]*")
_HTTP = re.compile(r"^https?://", re.I)


def check_environment(environ: Mapping[str, str] | None = None, backend: str | None = None) -> None:
    """Raise ConfigError (source `<environment>`, key the variable) for the first bad value."""
    environ = os.environ if environ is None else environ
    progress = environ.get(protocol.PROGRESS)
    if progress is not None and progress not in MODES:
        raise ConfigError(SOURCE, protocol.PROGRESS, "one of " + ", ".join(MODES), progress)
    timeout = environ.get(protocol.EXIT_TIMEOUT_S)
    if timeout is not None:
        _seconds(protocol.EXIT_TIMEOUT_S, timeout)
    for name in (protocol.CACHE, protocol.DEBUG):
        value = environ.get(name)
        if value is not None and value not in ("0", "1", ""):
            raise ConfigError(SOURCE, name, "0 or 1", value)
    forward = environ.get(protocol.FORWARD_ENV)
    if forward is not None:
        _forward(forward)
    _job_token(environ.get(protocol.JOB_TOKEN) or "")
    jobs = environ.get(protocol.JOBS_DIR)
    if jobs and os.path.exists(jobs) and not os.path.isdir(jobs):
        raise ConfigError(SOURCE, protocol.JOBS_DIR, "a directory (made when missing)", "an existing file")
    _accelerate_inputs(environ)
    if backend is not None and kind_of(backend).ray:
        ray_address(environ.get("RAY_ADDRESS"))
        if not ray_installed():
            raise ConfigError(SOURCE, "ray", 'the ray package for the Ray backend: pip install "ray[default]" '
                              "(or --backend torchrun)", "not installed")


def ray_installed() -> bool:
    """Whether `import ray` can work, without importing it (a second or more)."""
    import importlib.util

    try:
        return importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):
        return False


def _seconds(name: str, text: str) -> float:
    try:
        value = float(text) if len(text) < 40 else math.nan
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not MIN_TIMEOUT_S <= value <= MAX_SECONDS:
        raise ConfigError(SOURCE, name, f"a number of seconds in [{MIN_TIMEOUT_S:g}, {MAX_SECONDS:g}]", text)
    return value


def _forward(value: str) -> None:
    """Names or patterns, comma-separated: `*` alone would forward every variable of the launching shell (the
    allow-list exists so that it does not); `NAME=value` is an assignment, not a name. Linear in the value."""
    for item in forward_patterns(value):
        if item == "*" or set(item) <= {"*", "?"}:
            raise ConfigError(SOURCE, protocol.FORWARD_ENV, "names or patterns with a prefix (MY_VAR,MY_PREFIX_*), "
                              "not every variable", item)
        if not _NAME_OR_PATTERN.fullmatch(item):
            hint = "set the value in the launching shell or under `env:`" if "=" in item else ""
            raise ConfigError(SOURCE, protocol.FORWARD_ENV, "comma-separated variable names or patterns "
                              "(MY_VAR,MY_PREFIX_*)", item.split("=", 1)[0] + ("=..." if "=" in item else ""), hint)


def _accelerate_inputs(environ: Mapping[str, str]) -> None:
    """What accelerate reads from the environment while it prepares the workers' env: an integer it gives int()
    (`OMP_NUM_THREADS=abc` raised ValueError, reported against the config file), a flag its str_to_bool."""
    for name in ACCELERATE_ENV_INTS:
        value = environ.get(name)
        if value is not None and not re.fullmatch(r"\s*[+-]?\d{1,18}\s*", value):
            raise ConfigError(SOURCE, name, "an integer (accelerate reads it when it prepares the workers' "
                              "environment)", value)
    for name in ACCELERATE_ENV_FLAGS:
        value = environ.get(name)
        if value is not None and value.lower() not in TRUTH_VALUES:
            raise ConfigError(SOURCE, name, "1 or 0, true or false, yes or no, on or off (accelerate reads it when "
                              "it is imported)", value)


def _job_token(value: str) -> None:
    """The job's secret, when the user gives one: long enough not to be guessed, and a valid HTTP header value
    (the servers compare it in `X-Dualrun-Job-Token`). Its value is never shown (a secret-named variable)."""
    if not value:
        return
    expected = f"at least {MIN_JOB_TOKEN_CHARS} printable ASCII characters without spaces (unset: a fresh secret " \
               "per launch)"
    if len(value) < MIN_JOB_TOKEN_CHARS:
        count = f"{len(value)} character" + "s" * (len(value) > 1)
        raise ConfigError(SOURCE, protocol.JOB_TOKEN, expected, Said(count))
    if not all("!" <= c <= "~" for c in value):
        raise ConfigError(SOURCE, protocol.JOB_TOKEN, expected, Said("a space, control or non-ASCII character"))


def ray_address(value: str | None) -> None:
    """RAY_ADDRESS as dualrun and `ray.init` join it: the GCS address or a Ray Client one, not the dashboard's."""
    if value is None or not value.strip():
        return
    value = value.strip()
    if value in ("auto", "local"):
        return
    if _HTTP.match(value):
        raise ConfigError(SOURCE, "RAY_ADDRESS", "the cluster's GCS address HOST:6379 (what `ray start --head` "
                          "prints) or ray://HOST:10001, not the dashboard / Jobs URL", value)
    target = value[len("ray://"):] if value.startswith("ray://") else value
    if not host_port(target):
        raise ConfigError(SOURCE, "RAY_ADDRESS", "HOST:PORT, ray://HOST:PORT, auto or local", value)
