"""docs/troubleshooting.md read as claims: each entry's dualrun lines (the ```text block under "**dualrun says**"),
with their `<WORD>` placeholders turned into regexes, so a test can hold a real run's output to them. One parser for
tests/e2e/test_troubleshooting.py and the tier tests that prove an entry there (`says`): a reworded doc line or a
changed message fails the proof instead of drifting apart."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "troubleshooting.md"
NONE = "none"   # the proof comment of an entry that says plainly dualrun does not catch it

_PROOF = re.compile(r"^<!-- proof: ([a-z0-9-]+) -->$")
_PLACEHOLDER = re.compile(r"<\.\.\.>|<[A-Z][A-Z_]*>")
_NUMBERS = {"<N>": r"\d+(?:\.\d+)?", "<PORT>": r"\d+", "<K>": r"\d+", "<I>": r"\d+"}


@dataclass(frozen=True)
class Entry:
    """One symptom: its heading, the proof its comment names, and dualrun's lines ([] where dualrun says nothing)."""

    heading: str
    proof: str
    lines: tuple[str, ...]
    says_nothing: bool


def entries(text: str | None = None) -> list[Entry]:
    """Every `## ` section of the doc, in order."""
    text = DOC.read_text() if text is None else text
    out = []
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        body = section.splitlines()
        proof = next((m.group(1) for m in map(_PROOF.match, body) if m), "")
        says = next((i for i, line in enumerate(body) if line.startswith("**dualrun says")), None)
        lines: list[str] = []
        nothing = says is not None and "does not catch" in body[says]
        if says is not None and not nothing:
            start = next(i for i in range(says + 1, len(body)) if body[i].startswith("```"))
            end = next(i for i in range(start + 1, len(body)) if body[i].startswith("```"))
            lines = [line for line in body[start + 1:end] if line.strip()]
        out.append(Entry(body[0].strip(), proof, tuple(lines), nothing))
    return out


def entry(proof: str) -> Entry:
    found = [e for e in entries() if e.proof == proof]
    assert len(found) == 1, f"docs/troubleshooting.md: {len(found)} entries with proof {proof!r}"
    return found[0]


def pattern(line: str) -> re.Pattern[str]:
    """The doc's line as a regex of a whole output line: literal text, `<N>`/`<PORT>`/`<K>`/`<I>` numbers, any other
    `<WORD>` a non-empty stretch, `<...>` any stretch."""
    parts, pos = [], 0
    for m in _PLACEHOLDER.finditer(line):
        parts.append(re.escape(line[pos:m.start()]))
        parts.append(_NUMBERS.get(m.group(0), ".*?" if m.group(0) == "<...>" else ".+?"))
        pos = m.end()
    parts.append(re.escape(line[pos:]))
    return re.compile("".join(parts))


def unmatched(lines: tuple[str, ...] | list[str], output: str) -> list[str]:
    """The doc lines no line of `output` matches whole."""
    seen = [line.strip() for line in output.splitlines()]
    return [line for line in lines if not any(pattern(line).fullmatch(s) for s in seen)]


def says(proof: str, output: str) -> None:
    """Assert that `output` (a real run's) holds every dualrun line of the entry whose proof comment is `proof`."""
    doc = entry(proof)
    assert doc.lines, f"docs/troubleshooting.md: entry {doc.heading!r} quotes no dualrun line"
    missing = unmatched(doc.lines, output)
    assert not missing, f"docs/troubleshooting.md: {doc.heading!r}: no output line matches {missing}\n{output[-3000:]}"
