"""Errors that end a command with one clear line instead of a traceback."""
from __future__ import annotations

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


class DualrunError(Exception):
    """Base class: anything dualrun reports to the user as one line."""

    exit_code = 1


class ConfigError(DualrunError):
    """Bad input: names the file, the key and what was expected; exit code 2. The value is shown escaped and cut
    short, and never at all for a secret-named key."""

    exit_code = 2

    def __init__(self, source: str, key: str, expected: str, got: Any = None, hint: str = "") -> None:
        self.source, self.key, self.expected, self.got, self.hint = source, key, expected, got, hint
        super().__init__(self.line())

    def line(self) -> str:
        source = str(self.source) or "''"
        source = escaped(source if len(source) <= 80 else "..." + source[-77:])
        msg = f"{source}: {cut(escaped(str(self.key)), 80)}: expected {cut(escaped(self.expected), 140)}"
        if self.got is not None:
            if secret_key(str(self.key)):
                msg += f", got a {type(self.got).__name__} (value hidden: a secret-named key)"
            else:
                from dualrun.contract.redact import redact_data

                got = redact_data(self.got)
                msg += ", got " + shown(got)
        if self.hint:
            msg += f" ({cut(escaped(self.hint), 200)})"
        return cut(msg, LINE_CHARS)


class LaunchError(DualrunError):
    """The job could not start or failed; the message says which rank and why."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code
