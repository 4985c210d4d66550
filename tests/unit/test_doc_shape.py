"""The docs stay readable: no table cell over 200 characters, no paragraph over 8 lines.

Why: a reader scans a table row by row and a paragraph by its first lines; a 1,600-character cell or a 40-line
paragraph hides its facts. A paragraph's length is counted in lines of 120 characters (a 1,200-character line is
ten lines, however it is wrapped in the file), outside code blocks; each list item is a paragraph of its own.
200 characters is about two lines of a table column on a wide screen; 8 lines of 120 fit one glance.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from helpers import REPO

MAX_CELL = 200
MAX_LINES = 8
WIDTH = 120

DOCS = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]


def _cells(row: str) -> list[str]:
    """A table row's cells (a `\\|` inside a cell is not a border)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", row.strip())[1:-1]]


def _outside_code(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside a ``` block; a block's lines read as blank."""
    lines, fence = [], False
    for i, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fence = not fence
            lines.append((i, ""))
        else:
            lines.append((i, "" if fence else line))
    return lines


def _paragraphs(text: str) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of each paragraph: runs of prose lines, a list item starting a new one; headings,
    table rows and HTML comments end one."""
    out: list[tuple[int, list[str]]] = []
    cur: list[str] = []
    start = 0
    for i, line in _outside_code(text):
        s = line.strip()
        item = re.match(r"\s*([-*]|\d+\.)\s", line)
        if not s or s.startswith(("#", "|", "<!--")) or item:
            if cur:
                out.append((start, cur))
            cur = [line] if item else []
            start = i
            continue
        if not cur:
            start = i
        cur.append(line)
    if cur:
        out.append((start, cur))
    return out


def shape_problems(path: Path) -> list[str]:
    """`file:line: what` for each cell over MAX_CELL characters and each paragraph over MAX_LINES lines."""
    text = path.read_text()
    name = path.relative_to(REPO) if path.is_relative_to(REPO) else path.name
    found = [f"{name}:{i}: a table cell of {len(c)} characters (at most {MAX_CELL})"
             for i, line in _outside_code(text) if line.strip().startswith("|")
             for c in _cells(line) if len(c) > MAX_CELL]
    for start, lines in _paragraphs(text):
        n = sum(max(1, math.ceil(len(l) / WIDTH)) for l in lines)
        if n > MAX_LINES:
            found.append(f"{name}:{start}: a paragraph of {n} lines of {WIDTH} characters (at most {MAX_LINES})")
    return found


def test_the_rule_sees_a_long_cell_and_a_long_paragraph(tmp_path):
    doc = tmp_path / "probe.md"
    doc.write_text("| a | b |\n|---|---|\n| " + "x" * 201 + " | y \\| z |\n\n" + "word " * 200 + "\n\n"
                   + "- " + "item " * 100 + "\n- short\n\n```\n" + "code\n" * 50 + "```\n")
    problems = shape_problems(doc)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "a table cell of 201 characters (at most 200)",
        "a paragraph of 9 lines of 120 characters (at most 8)",
    ], problems


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_doc_keeps_its_shape(path):
    assert shape_problems(path) == []
