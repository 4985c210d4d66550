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


class DualrunError(Exception):
    """Base class: anything dualrun reports to the user as one line."""

    exit_code = 1


class ConfigError(DualrunError):
    """Bad input: names the file, the key and what was expected; exit code 2."""

    exit_code = 2

    def __init__(self, source: str, key: str, expected: str, got: Any = None, hint: str = "") -> None:
        self.source, self.key, self.expected, self.got, self.hint = source, key, expected, got, hint
        super().__init__(self.line())

    def line(self) -> str:
        msg = f"{self.source}: {self.key}: expected {self.expected}"
        if self.got is not None:
            got = self.got if isinstance(self.got, str) else repr(self.got)
            msg += f", got {got}"
        if self.hint:
            msg += f" ({self.hint})"
        return msg


class LaunchError(DualrunError):
    """The job could not start or failed; the message says which rank and why."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code
