"""The module graph of `dualrun/`: no import cycle, no import upward, a pure plan (function-level imports included).

Why: a cycle hides which module is the lower layer, and it only works while every import in it stays inside a
function; the next top-level import in one of its modules breaks the package at import time. An upward import
(the config or the plan reaching what starts processes) is how a pure layer stops being one.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "dualrun"
# the built-in method plugins: the top-level `plugins/` folder, installed as `dualrun.plugins` (pyproject.toml)
PACKAGES = {PKG: ("dualrun",), REPO / "plugins": ("dualrun", "plugins")}


def _modules() -> dict[str, Path]:
    mods = {}
    for root, prefix in PACKAGES.items():
        for path in root.rglob("*.py"):
            parts = prefix + path.relative_to(root).with_suffix("").parts
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
    """servers/ (the lifecycle), roles/ and the Ray resource layer sit below the launchers: none of them imports
    dualrun.launchers (the Ray layer imports none of its users either); the server programs (serving/) sit below
    the lifecycle that starts them; the worker side imports no driver-side package."""
    mods = _modules()
    graph = {name: _imports(name, path, mods) for name, path in mods.items()}
    lifecycle = ("dualrun.launchers", "dualrun.servers", "dualrun.roles", "dualrun.raycluster")
    below = {"dualrun.servers": ("dualrun.launchers",), "dualrun.roles": ("dualrun.launchers",),
             "dualrun.raycluster": ("dualrun.launchers", "dualrun.servers", "dualrun.roles"),
             "dualrun.serving": (*lifecycle, "dualrun.rank", "dualrun.plugin", "dualrun.plugins", "dualrun.plan"),
             "dualrun.rank": lifecycle}
    upward = sorted(f"{name} -> {dep}" for name, deps in graph.items() for pkg, banned in below.items()
                    if name == pkg or name.startswith(pkg + ".") for dep in deps
                    if any(dep == b or dep.startswith(b + ".") for b in banned))
    assert graph["dualrun.servers.ray_server"], "the import scan found nothing: it is broken"
    assert graph["dualrun.rank.bootstrap"], "the import scan missed the worker package"
    assert upward == []


# The plan is pure: placement and env from the config and a cluster, below everything that starts a process.
PLAN_LAYER = {"dualrun.plan", "dualrun.placement", "dualrun.engine_shape"}
# ... and it reads values only: the config's model, the protocol's names, the env builders, the errors.
PLAN_READS = PLAN_LAYER | {"dualrun.config.model", "dualrun.protocol", "dualrun.envspec", "dualrun.errors"}
# The config sits below the plan: it reads the file and checks values, and imports nothing that uses it.
CONFIG_READS = ("dualrun.config", "dualrun.errors", "dualrun.envspec", "dualrun.envinfo", "dualrun.protocol")
_ENV_CALLS = {"environ", "getenv", "putenv", "unsetenv", "environb"}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def _reached(graph: dict[str, set[str]], roots: set[str]) -> set[str]:
    """Every module `roots` import, directly or through others."""
    seen, todo = set(), list(roots)
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def _env_reads(source: str, defaults_ok: bool) -> list[int]:
    """Lines where `source` reads the process environment (os.environ, os.getenv, ...; `from os import
    environ`). With `defaults_ok`, a read inside a function that takes `environ` (its default) is allowed."""
    tree = ast.parse(source)
    allowed: set[int] = set()
    if defaults_ok:
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and "environ" in {
                    a.arg for a in fn.args.args + fn.args.kwonlyargs}:
                allowed.update(id(n) for n in ast.walk(fn))
    lines = []
    for node in ast.walk(tree):
        hit = (isinstance(node, ast.Attribute) and node.attr in _ENV_CALLS and isinstance(node.value, ast.Name)
               and node.value.id == "os") or (isinstance(node, ast.ImportFrom) and node.module == "os"
                                             and any(a.name in _ENV_CALLS for a in node.names))
        if hit and id(node) not in allowed:
            lines.append(node.lineno)
    return lines


def test_the_checkers_see_an_environment_read_and_an_import_outside():
    assert _env_reads("import os\nx = os.environ.get('A')\n", defaults_ok=False) == [2]
    assert _env_reads("from os import getenv\n", defaults_ok=False) == [1]
    reads_default = "import os\ndef f(environ=None):\n    return os.environ if environ is None else environ\n"
    assert _env_reads(reads_default, defaults_ok=True) == []
    assert _env_reads(reads_default, defaults_ok=False) == [3]
    assert _env_reads("import os\ndef f(env=None):\n    return os.getenv('A')\n", defaults_ok=True) == [3]
    assert _reached({"p": {"v"}, "v": {"s"}, "s": set()}, {"p"}) == {"v", "s"}


def test_the_plan_reads_no_environment_and_imports_only_values():
    """plan.py, the placement policies and the engines' shape: no environment of their own (the caller passes
    the launching shell's), and nothing of servers/, launchers/, Ray or anything else that starts or reads a
    process, even through another module; the values they read take the environment only as a default."""
    graph = _graph()
    mods = _modules()
    assert PLAN_LAYER <= set(graph) and graph["dualrun.plan"], "the import scan found nothing: it is broken"
    outside = sorted(_reached(graph, PLAN_LAYER) - PLAN_READS)
    assert outside == [], f"the plan reaches {outside}: pass the value in, or move the pure part down"
    own = {name: _env_reads(mods[name].read_text(), defaults_ok=False) for name in sorted(PLAN_LAYER)}
    assert {name: lines for name, lines in own.items() if lines} == {}
    values = {name: _env_reads(mods[name].read_text(), defaults_ok=True) for name in sorted(PLAN_READS)}
    assert {name: lines for name, lines in values.items() if lines} == {}


def test_config_imports_nothing_above_it():
    """dualrun.config reads the file and checks values: it reaches only itself, the errors, the env names, the
    machine's facts (envinfo) and the protocol; never the plan, the placement, a launcher, a server or a plugin."""
    graph = _graph()
    config = {name for name in graph if name == "dualrun.config" or name.startswith("dualrun.config.")}
    assert "dualrun.config.load" in config and graph["dualrun.config.load"], "the scan is broken"
    upward = sorted(f"{name} -> {dep}" for name in config for dep in _reached(graph, {name})
                    if not any(dep == low or dep.startswith(low + ".") for low in CONFIG_READS))
    assert upward == []


def _in(module: str, packages: tuple[str, ...] | set[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


# The worker side: what a rank imports (the entry point, the hooks, the plugins' worker halves) reaches only itself,
# the protocol, the standard-library-only modules and the gloo wire it shares with the server; never the config,
# the plan, a plugin's driver half, the server programs or anything that starts a process.
WORKER_SIDE = ("dualrun.rank", "dualrun.plugins.workers")
WORKER_READS = (*WORKER_SIDE, "dualrun.protocol", "dualrun.light", "dualrun.gloo_wire", "dualrun.job_store",
                "dualrun.funcs")
# A plugin's driver half reads the config and names its servers' command lines (serving.commands), and may import
# its own worker half; it never reaches the server programs themselves, the plan or the lifecycle.
PLUGIN_READS = (*CONFIG_READS, "dualrun.engine_shape", "dualrun.serving.commands", "dualrun.gloo_wire",
                "dualrun.light", "dualrun.plugin", "dualrun.plugins", *WORKER_READS)
# What the driver shares with the workers lives in the protocol or light/, not in the worker side itself.
SHARED_WITH_WORKERS = ("dualrun.protocol", "dualrun.light")


def test_the_worker_side_reaches_no_driver_side_module():
    """rank/bootstrap.py activates a method through dualrun/rank/method.py and the plugin's worker half: nothing a
    rank imports, even through another module, is the config, the plan, a plugin's driver half or a server."""
    graph = _graph()
    side = {name for name in graph if _in(name, WORKER_SIDE)}
    assert {"dualrun.rank.bootstrap", "dualrun.plugins.workers.gkd"} <= side and graph["dualrun.rank.bootstrap"], \
        "the import scan found nothing: it is broken"
    outside = sorted(f"{name} -> {dep}" for name in sorted(side) for dep in _reached(graph, {name})
                     if dep != "dualrun" and not _in(dep, WORKER_READS))
    assert outside == [], "the worker side reaches the driver side: split the module, or move the shared part down"


def test_plugins_reach_only_the_config_and_the_command_lines():
    """A method plugin's driver half (dualrun/plugin.py, plugins/*.py): the config, the engines' shape, the catalogue
    of command lines (dualrun.serving.commands) and its own worker half; not the plan, the servers' lifecycle,
    a server program or a launcher."""
    graph = _graph()
    plugins = {name for name in graph if _in(name, ("dualrun.plugin", "dualrun.plugins"))
               and not _in(name, WORKER_SIDE)}
    assert {"dualrun.plugin", "dualrun.plugins.grpo", "dualrun.plugins.gkd"} <= plugins, "the scan is broken"
    assert graph["dualrun.plugins.grpo"], "the import scan found nothing: it is broken"
    outside = sorted(f"{name} -> {dep}" for name in sorted(plugins) for dep in _reached(graph, {name})
                     if dep != "dualrun" and not _in(dep, PLUGIN_READS))
    assert outside == []


def test_the_driver_side_imports_nothing_of_the_worker_side():
    """Launchers, servers, the server programs, the plan and the config import no module of rank/: what both sides
    need (an env name, a port) lives in the protocol or light/ (e.g. `protocol.group_port_env`)."""
    graph = _graph()
    driver = {name for name in graph if not _in(name, (*WORKER_SIDE, "dualrun.plugins", "dualrun.plugin"))
              and not _in(name, SHARED_WITH_WORKERS) and name != "dualrun"}
    assert "dualrun.launchers.ray" in driver and graph["dualrun.launchers.ray"], "the scan is broken"
    into = sorted(f"{name} -> {dep}" for name in sorted(driver) for dep in graph[name] if _in(dep, WORKER_SIDE))
    assert into == []
