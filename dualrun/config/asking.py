"""`dualrun config`'s conversation: ask each question, ask again on an invalid answer, check the whole file.

Why the check is passed in: the file must be one `dualrun plan` takes, and that verdict needs the plan and the
method plugins, which sit above the config (tests/unit/test_layers.py); the command line passes its own `plan` check.
A refusal of the whole file names a key; the question answering that key is asked again, with the refusal's line.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Mapping

from dualrun.config.questions import Context, Invalid, blamed_question, config_of, next_question
from dualrun.contract.errors import ConfigError, one_line


def converse(ctx: Context, read: Callable[[str], str], say: Callable[[str], None],
             check: Callable[[Mapping[str, Any]], None]) -> dict[str, Any]:
    """Ask until every question has a valid answer and `check` (raising ConfigError) takes the file; the file's
    content. `read(prompt)` is one typed line (EOFError ends it); `say(line)` tells the user."""
    answers: dict[str, str] = {}
    while True:
        q = next_question(ctx, answers)
        if q is None:
            raw = config_of(ctx, answers)
            try:
                check(raw)
                return raw
            except ConfigError as e:
                again = blamed_question(ctx, answers, e.key)
                if again is None:
                    raise
                say(one_line(e.line()))
                answers.pop(again.key, None)
                continue
        typed = read(q.prompt())
        try:
            q.value(typed)
        except Invalid as why:
            say(one_line(q.complaint(typed, why)))
            continue
        answers[q.key] = typed


def write_file(path: str, text: str) -> None:
    """`text` at `path`: a new file, or one the user agreed to replace, replaced whole (its mode kept)."""
    import shutil
    import tempfile

    try:
        if not os.path.exists(path):
            with open(path, "x", encoding="utf-8") as f:
                f.write(text)
            return
        fd, tmp = tempfile.mkstemp(prefix=".dualrun-config-", dir=os.path.dirname(path) or ".")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            shutil.copymode(path, tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as e:   # no permission, a read-only disk, a file that appeared meanwhile
        raise ConfigError(path, "path", "a file in a writable folder", e.strerror or type(e).__name__) from None
