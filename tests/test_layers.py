"""The module graph of `dualrun/`: no import cycle (function-level imports included).

Why: a cycle hides which module is the lower layer, and it only works while every import in it stays inside a
function; the next top-level import in one of its modules breaks the package at import time.
"""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "dualrun"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PKG.rglob("*.py"):
        parts = ("dualrun",) + path.relative_to(PKG).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The dualrun modules `name` imports; `from pkg import sub` counts as importing `pkg.sub` only."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
            found.update(subs if len(subs) == len(node.names) else [base, *subs])
    resolved = set()
    for module in found:
        while module and module not in mods:
            module = module.rpartition(".")[0]
        if module and module != name:
            resolved.add(module)
    return resolved


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checker_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_inside_dualrun():
    mods = _modules()
    graph = {name: _imports(name, path, mods) for name, path in mods.items()}
    assert graph["dualrun.roles.group"], "the import scan found nothing: it is broken"
    assert _cycles(graph) == []


def test_no_module_imports_upward():
    """servers/, roles/ and the Ray resource layer sit below the launchers: none of them imports
    dualrun.launchers (the Ray layer imports none of its users either); the worker side imports no driver-side
    package."""
    mods = _modules()
    graph = {name: _imports(name, path, mods) for name, path in mods.items()}
    below = {"dualrun.servers": ("dualrun.launchers",), "dualrun.roles": ("dualrun.launchers",),
             "dualrun.raycluster": ("dualrun.launchers", "dualrun.servers", "dualrun.roles"),
             "dualrun.rank": ("dualrun.launchers", "dualrun.servers", "dualrun.roles", "dualrun.raycluster")}
    upward = sorted(f"{name} -> {dep}" for name, deps in graph.items() for pkg, banned in below.items()
                    if name == pkg or name.startswith(pkg + ".") for dep in deps
                    if any(dep == b or dep.startswith(b + ".") for b in banned))
    assert graph["dualrun.servers.ray_server"], "the import scan found nothing: it is broken"
    assert graph["dualrun.rank.bootstrap"], "the import scan missed the worker package"
    assert upward == []
