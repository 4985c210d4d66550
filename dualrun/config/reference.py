"""Render the configuration reference from the schema itself, so the docs cannot drift.

    python -m dualrun.config.reference > docs/config-reference.md
"""
from __future__ import annotations

import json
import re
import textwrap

from dualrun.config import schema
from dualrun.config.backends import owned_sections

MAX_CELL = 200   # tests/unit/test_doc_shape.py holds every doc to it: a longer text goes below its table


def _sentences(text: str, ends: str = ".") -> list[str]:
    """`text` cut after each of `ends` followed by a space, outside backticks and parentheses (not "e.g." / "i.e.")."""
    out, depth, tick, start = [], 0, False, 0
    for i, ch in enumerate(text):
        if ch == "`":
            tick = not tick
        elif not tick and ch in "([":
            depth += 1
        elif not tick and ch in ")]":
            depth = max(0, depth - 1)
        elif (not tick and depth == 0 and ch in ends and text[i + 1:i + 2] == " "
              and not text[max(0, i - 4):i + 1].endswith(("e.g.", "i.e."))):
            out.append(text[start:i + 1].strip())
            start = i + 2
    return [x for x in out + [text[start:].strip()] if x]


def _cell(name: str, text: str, notes: list[str]) -> str:
    """`text` where it fits a table cell; else its first sentence and "(more below)", the whole in `notes`."""
    if len(text) <= MAX_CELL:
        return text
    parts = _sentences(text)
    notes += [f"- `{name}`:"] + [line for part in _bullets(parts) for line in textwrap.wrap(
        part, 116, initial_indent="  - ", subsequent_indent="    ", break_long_words=False, break_on_hyphens=False)]
    first = parts[0] if len(parts[0]) <= MAX_CELL - 14 else re.sub(r"[,;:]?\s+\S*$", "", parts[0][:MAX_CELL - 16]) + " …"
    return f"{first} (more below)"


def _bullets(sentences: list[str], most: int = 560) -> list[str]:
    """Sentences joined into bullets of at most `most` characters (about 5 lines); a longer one cut at its "; "."""
    out: list[str] = []
    for part in sentences:
        for piece in (_sentences(part, ";") if len(part) > most else [part]):
            if out and len(out[-1]) + 1 + len(piece) <= most:
                out[-1] += " " + piece
            else:
                out.append(piece)
    return out


def _notes(notes: list[str]) -> list[str]:
    return ["More on the keys above:", "", *notes, ""] if notes else []


def _default(value) -> str:
    return "—" if value is None else f"`{json.dumps(value)}`"


def render() -> str:
    out = ["# Configuration reference", "",
           "Generated from `dualrun/config/schema.py` by `python -m dualrun.config.reference`; a test keeps it in "
           "sync. A config file holds accelerate's keys (with accelerate's meaning) and the dualrun keys below.", ""]
    titles = {"": "Top-level dualrun keys", "ray": "`ray:` section", "torchrun": "`torchrun:` section",
              "roles.<name>": "`roles.<name>:` — one entry per role"}
    sections = dict(schema.SECTIONS)
    for name, backend in owned_sections().items():   # a backend's own section (`Backend.section_keys`)
        sections[name] = tuple(backend.section_keys)
        titles[name] = f"`{name}:` section (declared by backend `{backend.name}`, checked on every backend)"
    for section, keys in sections.items():
        out += [f"## {titles[section]}", "", "| key | type | default | backend | meaning |", "|---|---|---|---|---|"]
        notes: list[str] = []
        for k in keys:
            kind = k.type + (f" ({' / '.join(map(str, k.choices))})" if k.choices else "")
            if k.minimum is not None:
                kind += f", >= {k.minimum:g}"
            if k.maximum is not None:
                kind += f", <= {k.maximum:g}"
            name = f"{section}.{k.name}" if section else k.name
            out.append(f"| `{name}` | {kind} | {_default(k.default)} | {k.backends} | {_cell(name, k.doc, notes)} |")
        out.append("")
        out += _notes(notes)
    out += ["## Refused keys", "", "Keys that would promise an effect nothing delivers: a config that sets one is "
            "refused (exit code 2) with what to use instead.", "", "| key | instead |", "|---|---|"]
    notes = []
    out += [f"| `{name}` | {_cell(name, instead, notes)} |" for name, instead in schema.REFUSED.items()]
    out.append("")
    out += _notes(notes)
    out += ["## accelerate keys", "",
            "Passed to accelerate's own config loading and env preparation unchanged; dualrun checks their types. "
            "Where dualrun does more (or accelerate's key does nothing on a torchrun or Ray launch), the last column "
            "says so.", "", "| key | type | under dualrun |", "|---|---|---|"]
    notes = []
    for name, kind in schema.ACCELERATE_TYPES.items():
        low_high = schema.ACCELERATE_BOUNDS.get(name)
        out.append(f"| `{name}` | {kind}" + (f", {low_high[0]}-{low_high[1]}" if low_high else "")
                   + f" | {_cell(name, schema.ACCELERATE_NOTES.get(name, ''), notes)} |")
    out += [""] + _notes(notes)
    out += ["", "## ms-swift `device_groups`", "",
            "`device_groups: {nproc_per_node: N, <group>: {device: GPU|CPU, ranks: list(range(a, b)) | [ids] | "
            "count, workers: [roles]}}` is converted to `roles` (workers of one group are colocated). `ranks` is "
            "parsed, never evaluated; the worker name `default` means `train`.", ""]
    out += ["## Limits", "", "Inputs past these end with one line and exit code 2 before anything starts.", "",
            "| what | at most | note |", "|---|---|---|"]
    notes = []
    out += [f"| {what} | {limit} | {_cell(what, note, notes)} |" for what, limit, note in schema.LIMITS]
    out += [""] + _notes(notes)
    out += ["## Environment variables", "", "Read by dualrun itself and checked like config keys before anything "
            "starts (a bad value: one line naming the variable, exit code 2).", "",
            "| variable | expected | meaning |", "|---|---|---|"]
    notes = []
    out += [f"| `{name}` | {expected} | {_cell(name, meaning, notes)} |" for name, expected, meaning in schema.ENV_VARS]
    out.append("")
    out += _notes(notes)
    return "\n".join(out)


if __name__ == "__main__":
    print(render(), end="")
