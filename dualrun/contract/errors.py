"""Errors that end a command with one clear line instead of a traceback."""
from __future__ import annotations

import re
from typing import Any


def killed_by(exit_code: int | None) -> str | None:
    """'killed by SIGKILL' for a negative exit code (a process ended by a signal), else None."""
    import signal

    if exit_code is None or exit_code >= 0:
        return None
    try:
        return f"killed by {signal.Signals(-exit_code).name}"
    except ValueError:
        return None


_STATE = {"started": False}


def mark_started() -> None:
    """From here on something may be running (a cluster joined or started, a process spawned): an unexpected
    error is no longer bad input (exit 2) but a failed start (exit 1)."""
    _STATE["started"] = True


def has_started() -> bool:
    return _STATE["started"]


# What a one-line error may show of user input: printable ASCII only, each part cut short, the line bounded.
SHOWN_CHARS = 60
LINE_CHARS = 280


def escaped(text: str) -> str:
    """`text` with every control, escape or non-ASCII character written as its escape (`\\n`, `\\x1b`): a value
    can neither forge a second line nor reach the terminal as a command."""
    return "".join(c if " " <= c <= "~" else c.encode("unicode_escape").decode("ascii") for c in text)


def cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: max(limit - 3, 1)] + "..."


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """A user's value as it may appear in a message: escaped and cut short (and then quoted); bounded work even for a
    huge or self-referencing value (a YAML alias bomb)."""
    import reprlib

    if isinstance(value, str):   # quoted when it has to be: escaped, cut, empty, padded or quoted itself
        text = cut(escaped(value[: limit * 8]), limit)
        plain = text == value and value.strip() == value and value and not any(q in value for q in "'\"`")
        return text if plain else "'" + text.replace("'", "\\'") + "'"
    r = reprlib.Repr()
    r.maxlevel, r.maxlist, r.maxtuple, r.maxdict, r.maxset = 2, 4, 4, 3, 3
    r.maxstring = r.maxother = r.maxlong = limit
    return cut(escaped(r.repr(value)), limit)


def one_line(text: str, limit: int = LINE_CHARS) -> str:
    """Any message made safe for a one-line report."""
    return cut(escaped(str(text)[: limit * 8]), limit)


def secret_key(key: str) -> bool:
    from dualrun.contract.redact import is_secret

    return is_secret(key)


class Said(str):
    """What dualrun says it got (`an unknown key`, `a directory`, `a value with NUL`): shown as written (escaped,
    redacted, cut), never quoted, and shown even where the user's own value would not be (an `env` value)."""


class AsString(str):
    """A user's string where another type was expected (`1e3`, `'60'`: YAML read them as text): shown as
    `the string '1e3'`, so that it is seen to be text."""


_KIND_WORDS = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
               tuple: "a list", dict: "a mapping", set: "a set", bytes: "binary data", type(None): "null"}


def type_words(value: Any) -> str:
    """`value`'s type in words (`a list`): what an error says of a value it must not show."""
    return next((word for kind, word in _KIND_WORDS.items() if type(value) is kind), "a " + type(value).__name__)


# A key shown in an error is a path of names (`roles.train.gpus`, `colocate_groups[0]`, `--machine_rank`, `<yaml>`):
# a part that is no name (a line of /etc/shadow read as a key, `HF_TOKEN=hf_...`) is described, not echoed.
_KEY_PART = re.compile(r"(?:[A-Za-z_][A-Za-z0-9_-]{0,63}|--[A-Za-z0-9][A-Za-z0-9_-]{0,63}|<[a-z ]{1,40}>|"
                       r"-?\d{1,20})(?:\[\d{1,9}\])*|(?:\[\d{1,9}\])+")
_OWN_KEYS = frozenset({"accelerate keys"})      # dualrun's own labels for what is no single key
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}=")
# Keys whose values are environment variables' (`env.NAME`, `roles.train.env`, `ray.runtime_env.env_vars.NAME`):
# any of them may be a credential, whatever its name, so none is shown.
_ENV_KEY = re.compile(r"^(?:(?:roles\.[^.]+\.)?env|ray\.runtime_env\.env_vars)(?:\..*)?$")


def not_a_name(text: str) -> str:
    """How an error names a key that is no name: by its length, never its text."""
    return f"<a key that is not a name ({len(text)} characters)>"


def shown_key(key: str) -> str:
    """`key` as an error may show it: its leading parts that are names, then `NAME=...` for an assignment (its
    value hidden) or a description of the first part that is no name (and all after it)."""
    from dualrun.contract.redact import looks_like_token

    if key in _OWN_KEYS:
        return key
    parts = key.split(".")
    good = 0
    while good < len(parts) and _KEY_PART.fullmatch(parts[good]) and not looks_like_token(parts[good]):
        good += 1
    if good == len(parts):
        return key
    rest = ".".join(parts[good:])
    m = _ASSIGNMENT.match(rest)
    tail = m.group(0) + "..." if m else not_a_name(rest)
    return ".".join(parts[:good] + [tail])


def shown_got(key: str, got: Any) -> str:
    """What an error shows of the value it got: dualrun's own words as written; nothing of a secret-named key's or
    an environment variable's value but its type; any other value redacted, escaped and cut short."""
    from dualrun.contract.redact import redact_data, redact_shown

    if isinstance(got, Said):
        return cut(escaped(redact_shown(str(got)[:1000])), 120)
    if secret_key(key):
        return f"{type_words(got)} (value hidden: a secret-named key)"
    if _ENV_KEY.search(key):
        return f"{type_words(got)} (not shown: an environment value)"
    if isinstance(got, AsString):
        return "the string '" + cut(escaped(redact_shown(str(got)[:1000])), SHOWN_CHARS).replace("'", "\\'") + "'"
    return shown(redact_data(got))


class DualrunError(Exception):
    """Base class: anything dualrun reports to the user as one line."""

    exit_code = 1


class ConfigError(DualrunError):
    """Bad input: names the file, the key and what was expected; exit code 2. The key and the value are shown as
    `shown_key` and `shown_got` allow: escaped, cut short, secrets never."""

    exit_code = 2

    def __init__(self, source: str, key: str, expected: str, got: Any = None, hint: str = "") -> None:
        self.source, self.key, self.expected, self.got, self.hint = source, key, expected, got, hint
        super().__init__(self.line())

    def line(self) -> str:
        from dualrun.contract.redact import redact_shown, redact_text

        source = redact_text(str(self.source)[-1000:]) or "''"
        source = escaped(source if len(source) <= 80 else "..." + source[-77:])
        key = str(self.key)
        expected = redact_shown(str(self.expected)[:1000])   # it may quote the user's values too
        msg = f"{source}: {cut(escaped(shown_key(key)), 80)}: expected {cut(escaped(expected), 140)}"
        if self.got is not None:
            msg += ", got " + shown_got(key, self.got)
        if self.hint:
            msg += f" ({cut(escaped(redact_shown(str(self.hint)[:1000])), 200)})"
        return cut(msg, LINE_CHARS)


class LaunchError(DualrunError):
    """The job could not start or failed; the message says which rank and why."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class ScaleRefused(DualrunError):
    """A resize of a running job's fleet (`dualrun scale`) it cannot make: one line why (an unknown role, a count
    out of its bounds, the job not running); exit code 2 for whoever asked."""

    exit_code = 2


class ScaleCutShort(DualrunError):
    """A resize the job's end cut short (its servers stopped while a replica was joining): one line, exit 1 for
    whoever asked (the request was fine; the job is gone)."""
