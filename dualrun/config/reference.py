"""Render the configuration reference from the schema itself, so the docs cannot drift.

    python -m dualrun.config.reference > docs/config-reference.md
"""
from __future__ import annotations

import json

from dualrun.config import schema


def _default(value) -> str:
    return "—" if value is None else f"`{json.dumps(value)}`"


def render() -> str:
    out = ["# Configuration reference", "",
           "Generated from `dualrun/config/schema.py` by `python -m dualrun.config.reference`; a test keeps it in "
           "sync. A config file holds accelerate's keys (with accelerate's meaning) and the dualrun keys below.", ""]
    titles = {"": "Top-level dualrun keys", "ray": "`ray:` section", "torchrun": "`torchrun:` section",
              "roles.<name>": "`roles.<name>:` — one entry per role"}
    for section, keys in schema.SECTIONS.items():
        out += [f"## {titles[section]}", "", "| key | type | default | backend | meaning |", "|---|---|---|---|---|"]
        for k in keys:
            kind = k.type + (f" ({' / '.join(map(str, k.choices))})" if k.choices else "")
            if k.minimum is not None:
                kind += f", >= {k.minimum:g}"
            if k.maximum is not None:
                kind += f", <= {k.maximum:g}"
            name = f"{section}.{k.name}" if section else k.name
            out.append(f"| `{name}` | {kind} | {_default(k.default)} | {k.backends} | {k.doc} |")
        out.append("")
    out += ["## Refused keys", "", "Keys that would promise an effect nothing delivers: a config that sets one is "
            "refused (exit code 2) with what to use instead.", "", "| key | instead |", "|---|---|"]
    out += [f"| `{name}` | {instead} |" for name, instead in schema.REFUSED.items()]
    out.append("")
    out += ["## accelerate keys", "",
            "Passed to accelerate's own config loading and env preparation unchanged; dualrun checks their types. "
            "Where dualrun does more (or accelerate's key does nothing on a torchrun or Ray launch), the last column "
            "says so.", "", "| key | type | under dualrun |", "|---|---|---|"]
    for name, kind in schema.ACCELERATE_TYPES.items():
        low_high = schema.ACCELERATE_BOUNDS.get(name)
        out.append(f"| `{name}` | {kind}" + (f", {low_high[0]}-{low_high[1]}" if low_high else "")
                   + f" | {schema.ACCELERATE_NOTES.get(name, '')} |")
    out += ["", "## ms-swift `device_groups`", "",
            "`device_groups: {nproc_per_node: N, <group>: {device: GPU|CPU, ranks: list(range(a, b)) | [ids] | "
            "count, workers: [roles]}}` is converted to `roles` (workers of one group are colocated). `ranks` is "
            "parsed, never evaluated; the worker name `default` means `train`.", ""]
    out += ["## Limits", "", "Inputs past these end with one line and exit code 2 before anything starts.", "",
            "| what | at most | note |", "|---|---|---|"]
    out += [f"| {what} | {limit} | {note} |" for what, limit, note in schema.LIMITS]
    out += ["", "## Environment variables", "", "Read by dualrun itself and checked like config keys before anything "
            "starts (a bad value: one line naming the variable, exit code 2).", "",
            "| variable | expected | meaning |", "|---|---|---|"]
    out += [f"| `{name}` | {expected} | {meaning} |" for name, expected, meaning in schema.ENV_VARS]
    out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(render(), end="")
