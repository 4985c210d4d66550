"""The benchmarks use dualrun's public names only.

Why: a benchmark that reaches a private name (`_x`) breaks, or silently measures something else, the next time
that name is renamed or its job changes; what a benchmark needs of dualrun is a seam, and a seam gets a public
name. The scan is syntactic (AST): a private name imported from dualrun, a private attribute of a dualrun module,
class or object (a name bound to something built from dualrun's names), and a patch table's `Class._method` path
next to a dualrun module's name.
"""
from __future__ import annotations

import ast
from pathlib import Path

from helpers import REPO

BENCHMARKS = REPO / "benchmarks"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _dualrun_module(module: str | None) -> bool:
    return bool(module) and (module == "dualrun" or module.startswith("dualrun."))


def _names_used(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def private_uses(source: str) -> list[str]:
    """`line: what` for each private dualrun name `source` reaches."""
    tree = ast.parse(source)
    found: list[str] = []
    dualrun: set[str] = set()   # local names bound to a dualrun module, class, function or object
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _dualrun_module(alias.name):
                    if any(_private(p) for p in alias.name.split(".")):
                        found.append(f"{node.lineno}: import {alias.name}")
                    dualrun.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and _dualrun_module(node.module):
            if any(_private(p) for p in node.module.split(".")):
                found.append(f"{node.lineno}: from {node.module}")
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
                dualrun.add(alias.asname or alias.name)
    for _ in range(3):   # names bound to what is built from those (`teacher = RemoteTeacher(...)`), a few hops
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and _names_used(node.value) & dualrun:
                dualrun.update(t.id for t in node.targets if isinstance(t, ast.Name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in dualrun:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                "getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2:
            target, attr = node.args[0], node.args[1]
            if isinstance(attr, ast.Constant) and isinstance(attr.value, str) and _private(attr.value) \
                    and _names_used(target) & dualrun:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Tuple):   # a patch table: ("dualrun.x", "Class._method", ...)
            texts = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if any(_dualrun_module(t) for t in texts):
                found += [f"{node.lineno}: {t}" for t in texts
                          if "." in t and not _dualrun_module(t) and any(_private(p) for p in t.split("."))]
    return sorted(set(found))


def test_the_scan_sees_each_way_of_reaching_a_private_name():
    assert private_uses("from dualrun.backends.ray.connect import _lean_node\n") == [
        "1: from dualrun.backends.ray.connect import _lean_node"]
    assert private_uses("import dualrun.backends.ray.actor_launcher as r\nr.RayLauncher._place(1)\n") == [
        "2: r.RayLauncher._place"]
    assert private_uses("from dualrun.rank.teacher import RemoteTeacher\nt = RemoteTeacher(1)\nt._client = 2\n") \
        == ["3: t._client"]
    assert private_uses("from dualrun.x import E\ne = E if 1 else None\nsetattr(e, '_mark', 1)\n") == [
        "3: setattr(e, '_mark', 1)"]
    assert private_uses("STEPS = (('dualrun.backends.ray.actor_launcher', 'RayLauncher._start', 'start'),)\n") == [
        "1: RayLauncher._start"]
    # another library's private name is that library's business; dualrun's public names are fine
    assert private_uses("import trl\nc = trl.VLLMClient()\nc._post = 1\nfrom dualrun.x import y\ny.z(c)\n") == []


def test_no_benchmark_uses_a_private_dualrun_name():
    scripts = sorted(BENCHMARKS.rglob("*.py"))
    assert len(scripts) > 10, "the benchmark scan found too little: it is broken"
    uses = {str(p.relative_to(REPO)): private_uses(p.read_text()) for p in scripts}
    assert {path: found for path, found in uses.items() if found} == {}
