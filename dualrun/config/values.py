"""Checking single values against a declared type, with one-line errors that name the key."""
from __future__ import annotations

import difflib
import math
import re
from typing import Any, Iterable

from dualrun.config.schema import MAX_DEVICE_ID, MAX_PROCESSES
from dualrun.contract.errors import AsString, ConfigError

_RANGE = re.compile(r"^\s*list\(\s*range\(\s*(-?\d+)\s*(?:,\s*(-?\d+)\s*)?(?:,\s*(-?\d+)\s*)?\)\s*\)\s*$")
_TYPE_WORDS = {
    "bool": "true or false",
    "int": "an integer",
    "float": "a number",
    "str": "a string",
    "dict": "a mapping",
    "list": "a list",
    "str-or-null": "a string or null",
    "int-or-null": "an integer or null",
}


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'?" if close else ""


def check(source: str, key: str, kind: str, value: Any, choices: tuple = (), minimum: float | None = None,
          maximum: float | None = None) -> Any:
    """Return `value` coerced to `kind`, or raise a ConfigError naming `key`. Numbers must be finite and within
    [minimum, maximum]. A number written as a string (`'60'`, `1e3`, which YAML 1.1 reads as text) is refused for
    int and float keys alike: accelerate's own config files store numbers as numbers."""
    expected = _TYPE_WORDS.get(kind, kind)
    if kind == "any":
        return value
    if value is None and kind.endswith("-or-null"):
        return None
    if kind.startswith("int"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(source, key, expected, _got(value), _number_hint(value))
    elif kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(source, key, expected, _got(value), _number_hint(value))
        try:
            value = float(value)
        except OverflowError:
            raise ConfigError(source, key, "a finite number", value) from None
        if not math.isfinite(value):
            raise ConfigError(source, key, "a finite number", value)
    elif kind == "bool":
        if isinstance(value, str) and value.lower() in ("true", "false"):
            value = value.lower() == "true"
        if not isinstance(value, bool):
            raise ConfigError(source, key, expected, _got(value))
    elif kind.startswith("str"):
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key.endswith(("gpu_ids", "_ip")):
            value = str(value)
        if not isinstance(value, str):
            raise ConfigError(source, key, expected, value)
    elif kind == "dict":
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise ConfigError(source, key, expected, _got(value))
    elif kind == "list":
        if value is None:
            value = []
        if not isinstance(value, list):
            raise ConfigError(source, key, expected, _got(value))
    if choices and value not in choices:
        shown = value
        hint = did_you_mean(str(value)[:100], [str(c) for c in choices])
        raise ConfigError(source, key, "one of " + ", ".join(str(c) for c in choices), shown, hint)
    word = "an integer" if kind.startswith("int") else "a number"
    if minimum is not None and value is not None and value < minimum:
        raise ConfigError(source, key, f"{word} >= {minimum:g}", value)
    if maximum is not None and value is not None and value > maximum:
        raise ConfigError(source, key, f"{word} <= {maximum:g}", value)
    return value


def _got(value: Any) -> Any:
    """A string where another type was expected is shown as one (`the string '1e3'`)."""
    return AsString(value) if isinstance(value, str) else value


def _number_hint(value: Any) -> str:
    """For a number YAML read as text: how to write it as a number."""
    if not isinstance(value, str) or len(value) > 40:
        return ""
    try:
        float(value)
    except ValueError:
        return ""
    if "e" in value.lower() and "." not in value:
        return "YAML reads 1e3 as text: write 1000 or 1.0e+3"
    return "write it without quotes"


def parse_ids(source: str, key: str, value: Any) -> tuple[int, ...] | None:
    """Device ids from `0,1`, `[0, 1]`, `list(range(0, 2))` or one int. Parsed, never evaluated."""
    if value is None or value == "all":
        return None
    if isinstance(value, bool):
        raise ConfigError(source, key, "device ids like [0, 1], '0,1' or list(range(0, 2))", value)
    if isinstance(value, int):
        ids: list[Any] = [value]
    elif isinstance(value, list):
        ids = value[: MAX_PROCESSES + 1]
    elif isinstance(value, str):
        m = _RANGE.match(value)
        if m:
            a, b, step = m.group(1), m.group(2), m.group(3)
            start, stop = (0, int(a)) if b is None else (int(a), int(b))
            if step is not None and int(step) == 0:
                raise ConfigError(source, key, "a range with a step other than 0", value)
            ids = range(start, stop, int(step) if step else 1)  # lazy: bounded before it is expanded
            if len(ids) > MAX_DEVICE_ID + 1 or (len(ids) and max(ids[0], ids[-1]) > MAX_DEVICE_ID):
                raise ConfigError(source, key, f"device ids in [0, {MAX_DEVICE_ID}]", value)
            ids = list(ids)
        elif re.fullmatch(r"\s*\d+\s*(,\s*\d+\s*)*", value):
            ids = [int(x) for x in value.split(",")[: MAX_PROCESSES + 1]]
        else:
            raise ConfigError(source, key, "device ids like [0, 1], '0,1' or list(range(0, 2))", value)
    else:
        raise ConfigError(source, key, "device ids like [0, 1], '0,1' or list(range(0, 2))", value)
    if not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise ConfigError(source, key, "a non-empty list of device ids >= 0", value)
    if max(ids) > MAX_DEVICE_ID:
        raise ConfigError(source, key, f"device ids in [0, {MAX_DEVICE_ID}]", max(ids))
    if len(set(ids)) != len(ids):
        raise ConfigError(source, key, "distinct device ids", value)
    return tuple(ids)
