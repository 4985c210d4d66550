"""Every module path and dotted name the code and the docs mention exists: `servers/ray_server.py` or
`dualrun.roles.runtime` in a docstring, after the module moved, sends a reader to nothing.

What is checked, in dualrun/, plugins/, docs/*.md, README.md and CONTRIBUTING.md (code and prose alike):
- a path to a `.py` file or a folder (`roles/modes.py`, `dualrun/role_programs/`): it exists below the folder of
  the file that says it or one above it, below `dualrun/`, or as `plugins/` for `dualrun/plugins/`;
- a bare file name (`group.py`): some file of the repository has it;
- a dotted name (`dualrun.light.ports.port_taken`): its longest module prefix is a module, and the first name after
  it is defined at that module's top level (a def, a class, an assignment, an import, or a lazily loaded name).
Another project's paths (`trl/...`, `vllm/...`), the docs' example package and placeholders (`tests/unit/X.py`) are
not ours to check.
"""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

from helpers import REPO

SCANNED = sorted([*(REPO / "dualrun").rglob("*.py"), *(REPO / "plugins").rglob("*.py"),
                  *(REPO / "docs").glob("*.md"), REPO / "README.md", REPO / "CONTRIBUTING.md"])
# the first folder of a path that is another project's (or the docs' example plugin package, docs/plugins.md)
FOREIGN = {"trl", "vllm", "ray", "dualrun_judge"}
# a module that gives another's names (dualrun/roles.py, the role-program package's old name)
ALIASES = {"dualrun.roles": "dualrun.role_programs"}
FILE_NAMES = {"sbatch", "py", "yaml", "yml", "json", "jsonl", "md", "log", "txt", "toml", "sh", "csv", "whl", "cfg"}

# a path to a .py file; a folder only as a whole `code span` (`roles/`: a key `dualrun/server/{index}` is no path)
_PATH = re.compile(r"(?<![\w./:@~<>{}*-])((?:[\w-]+/)+[\w-]+\.py)\b|`((?:[\w-]+/)+)`")
_BARE = re.compile(r"(?<![\w./:@~<>{}*-])([a-z_][a-z0-9_]*\.py)\b")
# the user's files the docs and messages name as examples, not ours
EXAMPLE_FILES = {"script.py", "train.py", "prog.py", "score.py", "your_grpo.py", "dualrun_placeholder.py"}
_DOTTED = re.compile(r"(?<![\w./])dualrun(?:\.[A-Za-z_]\w*)+")


def _modules() -> dict[str, Path]:
    mods = {}
    for root, prefix in ((REPO / "dualrun", ("dualrun",)), (REPO / "plugins", ("dualrun", "plugins"))):
        for path in root.rglob("*.py"):
            parts = prefix + path.relative_to(root).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _top_names(path: Path) -> set[str]:
    """What a module defines at its top level (inside `if`/`try` blocks too), with its lazy names: the keys of
    `_LAZY`/`_WHERE` (PEP 562 `__getattr__` tables) and `__all__`."""
    names: set[str] = set()
    todo = list(ast.parse(path.read_text(), str(path)).body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.If, ast.Try)):
            todo += [*node.body, *node.orelse, *getattr(node, "finalbody", []),
                     *(s for h in getattr(node, "handlers", []) for s in h.body)]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        names.add(n.id)
                        if n.id in ("_LAZY", "_WHERE", "__all__") and node.value is not None:
                            names.update(_string_keys(node.value))
    return names


def _string_keys(value: ast.expr) -> set[str]:
    """The string constants of a dict's keys or a list's items, and of the tuples a `{name: ... for name in (...)}`
    comprehension spreads into the dict."""
    found: set[str] = set()
    for node in ast.walk(value):
        if isinstance(node, ast.Dict):
            found.update(k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
        elif isinstance(node, (ast.List, ast.Tuple)):
            found.update(e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str))
    return found


def _path_exists(token: str, said_in: Path) -> bool:
    first = token.split("/")[0]
    if first in FOREIGN or any(part.isupper() or part.startswith("<") for part in re.split(r"[/.]", token) if part):
        return True
    token = token.rstrip("/")
    bases = [*said_in.parents, REPO / "dualrun"]
    if token == "dualrun/plugins" or token.startswith("dualrun/plugins/"):
        token = token.removeprefix("dualrun/")
    if any((base / token).exists() for base in bases if base == REPO or REPO in base.parents):
        return True
    return not token.endswith(".py") and token in _repo_folders()   # a folder named in a picture (`actors/`)


@functools.lru_cache(maxsize=1)
def _repo_folders() -> frozenset[str]:
    """Every folder of dualrun/ and plugins/, and each of its tails (`backends/ray/actors`, `ray/actors`, `actors`)."""
    found = set()
    for root in (REPO / "dualrun", REPO / "plugins"):
        for path in root.rglob("*"):
            if path.is_dir() and "__pycache__" not in path.parts:
                parts = path.relative_to(REPO).parts
                found.update("/".join(parts[i:]) for i in range(len(parts)))
    return frozenset(found)


def _stale(text: str, said_in: Path, mods: dict[str, Path], names: dict[str, set[str]],
           file_names: set[str]) -> list[str]:
    found = []
    for line in text.splitlines():
        for file, folder in _PATH.findall(line):
            if not _path_exists(file or folder, said_in):
                found.append(file or folder)
        for token in _BARE.findall(line):
            if token not in file_names and token not in EXAMPLE_FILES:
                found.append(token)
        for token in _DOTTED.findall(line):
            parts = token.split(".")
            if parts[-1] in FILE_NAMES and len(parts) == 2:   # dualrun.yaml, a file's name
                continue
            i = len(parts)
            while i and ".".join(parts[:i]) not in mods:
                i -= 1
            module = ".".join(parts[:i])
            if module not in names:
                names[module] = _top_names(mods[module]) | (_top_names(mods[ALIASES[module]]) if module in ALIASES
                                                            else set())
            if i < len(parts) and parts[i] not in names[module]:
                found.append(token)
    return found


def _repo_file_names() -> set[str]:
    """The name of every .py file of the repository's own folders (not a virtual environment's, not a run's)."""
    tops = [p for p in REPO.iterdir() if p.is_dir() and not p.is_symlink() and not p.name.startswith(".")
            and p.name not in {"build", "dist", "runs", "tiny"}]
    return {p.name for top in tops for p in top.rglob("*.py")} | {p.name for p in REPO.glob("*.py")}


def test_the_checker_sees_a_stale_path_and_name_and_passes_live_ones():
    mods, file_names = _modules(), _repo_file_names()
    here = REPO / "dualrun" / "role_programs" / "modes.py"
    live = ("role_programs/child_workers.py, backends/ray/actor_groups.py, `dualrun/role_programs/`, group.py, "
            "plugins/workers/gkd_worker.py, dualrun.light.ports.port_taken, dualrun.worker, dualrun.yaml, `actors/`, "
            "`<method>_worker.py`, train.py, dualrun/server/{index}, "
            "dualrun.role_programs.workers.LocalWorkers, trl/trainer/utils.py, tests/unit/X.py")
    assert _stale(live, here, mods, {}, file_names) == []
    dead = ("roles/ray_backend.py, `dualrun/roles/`, `roles/`, ray_server.py, dualrun.roles.runtime, "
            "dualrun.light.ports.nope, dualrun.nothing")
    assert _stale(dead, here, mods, {}, file_names) == ["roles/ray_backend.py", "dualrun/roles/", "roles/",
                                                        "ray_server.py", "dualrun.roles.runtime",
                                                        "dualrun.light.ports.nope", "dualrun.nothing"]


def test_every_module_path_and_dotted_name_mentioned_exists():
    mods, file_names, names = _modules(), _repo_file_names(), {}
    assert len(SCANNED) > 150 and "dualrun.role_programs.runtime" in mods, "the scan found too little: it is broken"
    stale = {f"{path.relative_to(REPO)}": found for path in SCANNED
             if (found := _stale(path.read_text(), path, mods, names, file_names))}
    assert stale == {}
