"""The module graph of `dualrun/`: no import cycle, no import upward, a pure plan (function-level imports included).

Why: a cycle hides which module is the lower layer, and it only works while every import in it stays inside a
function; the next top-level import in one of its modules breaks the package at import time. An upward import
(the config or the plan reaching what starts processes) is how a pure layer stops being one.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "dualrun"
# the built-in method plugins: the top-level `plugins/` folder, installed as `dualrun.plugins` (pyproject.toml)
# imports under `if TYPE_CHECKING:` count too: an annotation naming a module above is a seam the wrong way round
COUNT_TYPE_CHECKING = True
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
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _type_checking(block.test)
                   for stmt in block.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in typing_only and not COUNT_TYPE_CHECKING:
            continue
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


def _type_checking(test: ast.expr) -> bool:
    """`if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`): imports for annotations only, never run."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


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
    assert graph["dualrun.role_programs.group"], "the import scan found nothing: it is broken"
    assert _cycles(graph) == []


# Every module's floor, by the longest name below that matches it (a package, or a module of a package whose other
# modules sit higher). A module imports only modules of its own floor or lower: data flows config -> plan ->
# launchers -> workers, and what two sides share sits below both.
FLOORS = {
    # the driver-worker contract and the standard-library-only pieces every process shares; the weight sync's wire
    "dualrun.contract": 0, "dualrun.light": 0, "dualrun.weightsync.wire": 0,
    # what reaches a worker's environment; the worker side (inside a rank, inside vLLM)
    "dualrun.env": 1, "dualrun.rank": 1, "dualrun.plugins.workers": 1, "dualrun.weightsync.trainer": 1,
    "dualrun.weightsync.engine": 1, "dualrun.weightsync.probe": 1, "dualrun.weightsync.stream": 1,
    "dualrun.weightsync.links": 1,
    # the config: the file, its values, the variables set for dualrun
    "dualrun.config": 2,
    # the plan (pure) and the programs that run as servers
    "dualrun.plan": 3, "dualrun.programs": 3,
    # the methods' driver halves and their servers' command lines, the weight-sync group a job forms and the check's
    # rehearsal of it
    "dualrun.methods": 4, "dualrun.plugins": 4, "dualrun.weightsync": 4,
    # the lifecycle: the servers, the role runtime
    "dualrun.servers": 5, "dualrun.role_programs": 5,
    # the launchers' contract and `dualrun check`'s table
    "dualrun.launchers": 6, "dualrun.check": 6,
    # the backends: what a backend is (base), then one folder each, all of it there (BACKEND_FLOORS)
    "dualrun.backends": 7, **{f"dualrun.backends.{name}": 7 for name in ("torchrun", "ray")},
    # the entry points: the API, the command line
    "dualrun.api": 8, "dualrun.cli": 9, "dualrun.__main__": 10,
    # the role-program API's old name, kept for code written against it (it reads dualrun.role_programs)
    "dualrun.roles": 8,
}
# everything else lives in a package
ROOT_MODULES = {"dualrun", "dualrun.api", "dualrun.cli", "dualrun.__main__", "dualrun.roles"}


def _floor(module: str) -> int | None:
    for prefix in sorted(FLOORS, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return FLOORS[prefix]
    return None


def test_every_module_has_a_floor_and_the_root_holds_only_the_entry_points():
    mods = _modules()
    assert len(mods) > 100, "the module scan found too little: it is broken"
    assert sorted(m for m in mods if m != "dualrun" and _floor(m) is None) == []
    assert sorted(m for m in mods if m.count(".") == 1 and not (mods[m].name == "__init__.py")) == \
        sorted(ROOT_MODULES - {"dualrun"})


def test_no_module_imports_above_its_floor():
    """A module imports modules of its own floor or lower (the package root, `dualrun`, with the version and the
    lazy public names, is read by all): the lifecycle never reaches a launcher, a server program never the
    lifecycle that starts it, the worker side never the config or the plan."""
    graph = _graph()
    assert graph["dualrun.backends.ray.actor_servers"] and graph["dualrun.rank.bootstrap"], "the import scan is broken"
    upward = sorted(f"{name} ({_floor(name)}) -> {dep} ({_floor(dep)})" for name, deps in graph.items()
                    if name != "dualrun" for dep in deps if dep != "dualrun" and _floor(dep) > _floor(name))
    assert upward == []


def test_the_floor_checker_sees_an_import_upward():
    assert _floor("dualrun.servers.local") == 5 and _floor("dualrun.weightsync.wire") == 0
    assert _floor("dualrun.weightsync.sync_group") == 4 and _floor("dualrun.plugins.workers.gkd_worker") == 1
    assert _floor("dualrun.launchers") == 6 and _floor("dualrunx") is None


# The plan is pure: placement and env from the config and a cluster, below everything that starts a process.
PLAN_LAYER = {"dualrun.plan.processes", "dualrun.plan.placement", "dualrun.plan.engines", "dualrun.plan.servers",
              "dualrun.plan.meeting", "dualrun.plan.server_commands", "dualrun.plan.optional"}
# ... and it reads values only: the config's model, the backends' and the engines' records, the protocol's names,
# the env builders, the errors, the interpreter placeholder.
PLAN_READS = PLAN_LAYER | {"dualrun.config.model", "dualrun.config.backends", "dualrun.config.engine_kinds",
                           "dualrun.config.fleet",
                           "dualrun.contract.protocol", "dualrun.env.worker", "dualrun.contract.errors",
                           "dualrun.contract.redact", "dualrun.light.interpreter"}
# The config sits below the plan: it reads the file and checks values, and imports nothing that uses it.
CONFIG_READS = ("dualrun.config", "dualrun.contract.errors", "dualrun.contract.redact", "dualrun.env.worker",
                "dualrun.env.installed", "dualrun.contract.protocol", "dualrun.light.progress")
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
    """plan/processes.py, the placement policies and the engines' shape: no environment of their own (the caller passes
    the launching shell's), and nothing of servers/, launchers/, Ray or anything else that starts or reads a
    process, even through another module; the values they read take the environment only as a default."""
    graph = _graph()
    mods = _modules()
    assert PLAN_LAYER <= set(graph) and graph["dualrun.plan.processes"], "the import scan found nothing: it is broken"
    outside = sorted(_reached(graph, PLAN_LAYER) - PLAN_READS)
    assert outside == [], f"the plan reaches {outside}: pass the value in, or move the pure part down"
    own = {name: _env_reads(mods[name].read_text(), defaults_ok=False) for name in sorted(PLAN_LAYER)}
    assert {name: lines for name, lines in own.items() if lines} == {}
    values = {name: _env_reads(mods[name].read_text(), defaults_ok=True) for name in sorted(PLAN_READS)}
    assert {name: lines for name, lines in values.items() if lines} == {}


def test_config_imports_nothing_above_it():
    """dualrun.config reads the file and checks values: it reaches only itself, the errors, the env names, the
    installed packages (env.installed), the progress modes and the protocol; never the plan, the placement, a launcher, a server or a plugin."""
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
WORKER_SIDE = ("dualrun.rank", "dualrun.plugins.workers", "dualrun.weightsync.trainer", "dualrun.weightsync.engine")
WORKER_READS = (*WORKER_SIDE, "dualrun.contract.protocol", "dualrun.contract.job_token", "dualrun.light",
                "dualrun.weightsync.wire",
                "dualrun.weightsync.stream", "dualrun.contract.job_store", "dualrun.contract.calls")
# A plugin's driver half reads the config and names its servers' command lines (methods.commands), and may import
# its own worker half; it never reaches the server programs themselves, the plan or the lifecycle.
PLUGIN_READS = (*CONFIG_READS, "dualrun.plan.engines", "dualrun.methods.commands", "dualrun.weightsync.wire",
                "dualrun.light", "dualrun.methods.plugin", "dualrun.plugins", *WORKER_READS)
# What the driver shares with the workers lives in the protocol or light/, not in the worker side itself.
SHARED_WITH_WORKERS = ("dualrun.contract.protocol", "dualrun.contract.job_token", "dualrun.light")


def test_the_worker_side_reaches_no_driver_side_module():
    """rank/bootstrap.py activates a method through dualrun/rank/method.py and the plugin's worker half: nothing a
    rank imports, even through another module, is the config, the plan, a plugin's driver half or a server."""
    graph = _graph()
    side = {name for name in graph if _in(name, WORKER_SIDE)}
    assert {"dualrun.rank.bootstrap", "dualrun.plugins.workers.gkd_worker"} <= side and graph["dualrun.rank.bootstrap"], \
        "the import scan found nothing: it is broken"
    outside = sorted(f"{name} -> {dep}" for name in sorted(side) for dep in _reached(graph, {name})
                     if dep != "dualrun" and not _in(dep, WORKER_READS))
    assert outside == [], "the worker side reaches the driver side: split the module, or move the shared part down"


def test_plugins_reach_only_the_config_and_the_command_lines():
    """A method plugin's driver half (dualrun/methods/plugin.py, plugins/*.py): the config, the engines' shape, the catalogue
    of command lines (dualrun.methods.commands) and its own worker half; not the plan, the servers' lifecycle,
    a server program or a launcher."""
    graph = _graph()
    plugins = {name for name in graph if _in(name, ("dualrun.methods.plugin", "dualrun.plugins"))
               and not _in(name, WORKER_SIDE)}
    assert {"dualrun.methods.plugin", "dualrun.plugins.grpo", "dualrun.plugins.gkd"} <= plugins, "the scan is broken"
    assert graph["dualrun.plugins.grpo"], "the import scan found nothing: it is broken"
    outside = sorted(f"{name} -> {dep}" for name in sorted(plugins) for dep in _reached(graph, {name})
                     if dep != "dualrun" and not _in(dep, PLUGIN_READS))
    assert outside == []


def test_the_driver_side_imports_nothing_of_the_worker_side():
    """Launchers, servers, the server programs, the plan and the config import no module of rank/: what both sides
    need (an env name, a port) lives in the protocol or light/ (e.g. `protocol.group_port_env`)."""
    graph = _graph()
    driver = {name for name in graph if not _in(name, (*WORKER_SIDE, "dualrun.plugins", "dualrun.methods.plugin"))
              and not _in(name, SHARED_WITH_WORKERS) and name != "dualrun"}
    assert "dualrun.backends.ray.actor_launcher" in driver and graph["dualrun.backends.ray.actor_launcher"], "the scan is broken"
    into = sorted(f"{name} -> {dep}" for name in sorted(driver) for dep in graph[name] if _in(dep, WORKER_SIDE))
    assert into == []


# Each backend's folder: everything of that backend, and nothing else imports it (the registry loads it by name).
BACKEND_FOLDERS = ("dualrun.backends.torchrun", "dualrun.backends.ray")


def _inside(module: str, folder: str) -> bool:
    return module == folder or module.startswith(folder + ".")


def test_a_backend_is_a_plug_no_module_outside_its_folder_imports_it():
    """The core, the entry points and the other backends reach a backend through the registry
    (dualrun/config/backends.py: `BUILT_IN` names its package, an entry point another's), never by an import."""
    mods = _modules()
    graph = {name: _imports(name, path, mods) for name, path in mods.items()}
    assert any(_inside(d, "dualrun.backends.ray") for d in graph["dualrun.backends.ray.ray_backend"]), "scan broken"
    reached = sorted(f"{name} -> {dep}" for name, deps in graph.items() for dep in deps for folder in BACKEND_FOLDERS
                     if _inside(dep, folder) and not _inside(name, folder))
    assert reached == []


def _imports_ray(path: Path) -> bool:
    tree = ast.parse(path.read_text(), str(path))
    return any((isinstance(n, ast.Import) and any(a.name.split(".")[0] == "ray" for a in n.names)) or
               (isinstance(n, ast.ImportFrom) and not n.level and (n.module or "").split(".")[0] == "ray")
               for n in ast.walk(tree))


def test_ray_is_imported_only_in_its_backends_folder():
    mods = _modules()
    importers = sorted(name for name, path in mods.items() if _imports_ray(path))
    assert "dualrun.backends.ray.connect" in importers, "the scan found no `import ray`: it is broken"
    assert [name for name in importers if not _inside(name, "dualrun.backends.ray")] == []


def test_no_two_modules_share_a_file_name():
    """A name says what a module is wherever it is read (a traceback, an import line): no `group.py` meaning a
    role program's group in one package and the weight-sync group in another."""
    names: dict[str, list[str]] = {}
    for name, path in _modules().items():
        if path.name != "__init__.py":
            names.setdefault(path.name, []).append(name)
    assert len(names) > 100, "the scan found too little: it is broken"
    assert {n: mods for n, mods in names.items() if len(mods) > 1} == {}


# What an engine is lives in its record (dualrun/config/engine_kinds.py) and which roles do what in the methods'
# plugins; the engine's own worker side (inside vLLM) may name vLLM's API. Nowhere else decides by such a name.
DECIDED_NAMES = {"vllm", "transformers", "rollout", "teacher"}
NAMES_MAY_DECIDE = ("dualrun.config.engine_kinds", "dualrun.methods", "dualrun.plugins", "dualrun.weightsync.engine")


def _name_decisions(source: str) -> list[int]:
    """Lines where `source` decides by an engine's or a role's name: a string of DECIDED_NAMES compared (`==`,
    `!=`, `in`, `not in`, alone or in a tuple, list or set) or passed to `.role(...)`/`.is_separate(...)`. A
    string that merely says a name (an error message, a log line) is no decision."""
    def named(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in DECIDED_NAMES
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(named(e) for e in node.elts)
        return False

    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                                 for op in node.ops):
            if named(node.left) or any(named(c) for c in node.comparators):
                lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("role", "is_separate") and any(named(a) for a in node.args):
            lines.append(node.lineno)
    return sorted(set(lines))


def test_the_name_checker_sees_a_decision_and_not_a_message():
    assert _name_decisions('if engine == "vllm":\n    pass\n') == [1]
    assert _name_decisions('x = role.name in ("teacher", "x")\n') == [1]
    assert _name_decisions('x = "rollout" in p.roles\n') == [1]
    assert _name_decisions('r = cfg.role("rollout")\n') == [1]
    assert _name_decisions('raise ValueError("a rollout on vllm")\nx = engine == "torchrun"\n') == []


def test_no_engine_or_role_name_decides_outside_its_record_and_the_plugins():
    """An engine is asked what it does (`EngineKind`), a method which of its roles take its weights
    (`MethodPlugin.weight_roles`): a new engine or method changes no module of the core."""
    mods = _modules()
    assert _name_decisions(mods["dualrun.plugins.grpo"].read_text()), "the scan sees nothing: it is broken"
    found = {name: lines for name, path in sorted(mods.items()) if not _in(name, NAMES_MAY_DECIDE)
             and (lines := _name_decisions(path.read_text()))}
    assert found == {}
