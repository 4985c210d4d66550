"""The suite's fixtures and collection rules, for every folder under tests/ (tests/README.md says which folder a test
goes in; what tests import lives in tests/support/, on sys.path through pyproject.toml's `pythonpath`). Tests that
start torchrun or Ray need a loopback-only network namespace (`unshare -n` + `ip link set lo up`, as .ci/run does);
elsewhere they are skipped with that reason."""
from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
from pathlib import Path

import pytest

import folders
import helpers

# DeepSpeed JIT-builds its CPU op into TORCH_EXTENSIONS_DIR with the `ninja` on PATH. scripts/setup.sh built it into
# this venv with the venv's ninja, so a run that finds that ninja first (scripts/test.sh, an activated venv) reuses
# it and no test pays the build. Under another ninja (each version reads the other's build log as stale) it would be
# rebuilt there, so such a run keeps torch's default directory.
_venv_ninja = Path(sys.executable).parent / "ninja"
if _venv_ninja.exists() and shutil.which("ninja") and os.path.samefile(shutil.which("ninja"), _venv_ninja):
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch-extensions"))

# Fixtures that are a Ray cluster: a test that takes one (directly or through another fixture) uses Ray.
RAY_FIXTURES = ("ray_cluster", "local_ray")


def mark_ray(item) -> None:
    """Mark `ray` the tests whose declarations say they use Ray, so no test needs to repeat it: those that take a
    Ray cluster fixture, and the "ray" case of an end-to-end test parametrized by `backend` (its "torchrun" case
    starts no cluster). Any other test that starts or joins one carries `@pytest.mark.ray` itself."""
    callspec = getattr(item, "callspec", None)
    ray_case = callspec is not None and callspec.params.get("backend") == "ray" and "e2e" in item.keywords
    if ray_case or set(RAY_FIXTURES) & set(item.fixturenames):
        item.add_marker(pytest.mark.ray)


def uses_ray(item) -> bool:
    """A test that starts or joins a Ray cluster: one marked `ray` (by itself, its module or `mark_ray`)."""
    return item.get_closest_marker("ray") is not None


def starts_own_ray(item) -> bool:
    """A Ray test that starts a cluster of its own (an embedded `dualrun launch --backend ray`, `ray start`, a
    FakeGpuCluster of another shape, an in-process `ray.init(address="local")`), as opposed to one that only joins
    this worker's running cluster: it takes `ray_cluster` or `ray_cluster_if_ray` (directly or through a module
    fixture)."""
    if not uses_ray(item):
        return False
    shared = bool({"ray_cluster", "ray_cluster_if_ray"} & set(item.fixturenames))
    return not shared or "local_ray" in item.fixturenames


def pytest_configure(config):
    """SIGTERM ends the run as Ctrl-C does: the fixtures tear down, so the Ray clusters and servers they started
    stop too. A cancelled CI job gets SIGTERM, and so does the vLLM tier that scripts/test.sh runs in the background
    (where SIGINT is ignored)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _interrupted)


def _interrupted(signum, frame):
    raise KeyboardInterrupt


def skip_cluster(items) -> None:
    """The cluster tier (marker `cluster`: tests on tests/support/vcluster.py's machines) runs on its own, beside the
    main suite (scripts/test-cluster.sh sets DUALRUN_CLUSTER_TIER=1); a cluster test of the vLLM tier (also marked
    `vllm`: it needs .venv-vllm) runs in that tier instead. Elsewhere, and where no cluster can be made, they are
    skipped with the reason."""
    import vcluster

    tier = os.environ.get("DUALRUN_CLUSTER_TIER") == "1"
    cannot = vcluster.available()
    for item in items:
        if item.get_closest_marker("cluster") is None:
            continue
        why = cannot
        if not tier and item.get_closest_marker("vllm") is None:
            why = "the cluster tier: bash scripts/test-cluster.sh"
        if why:
            item.add_marker(pytest.mark.skip(reason=why))


def refuse_misplaced(items) -> None:
    """A test in the wrong folder of tests/ (tests/support/folders.py) ends the collection with one line naming it:
    the scripts pick the vLLM and cluster tiers by folder, so it would run in no tier or in the wrong venv."""
    here = Path(__file__).resolve().parent
    seen: dict[Path, str | None] = {}
    for item in items:
        if item.path not in seen:
            seen[item.path] = None
            path = item.path.resolve()
            if path.is_relative_to(here):
                seen[item.path] = str(path.relative_to(here))
        if seen[item.path] is None:
            continue
        why = folders.misplaced(Path(seen[item.path]).parts, {m.name for m in item.iter_markers()})
        if why:
            raise pytest.UsageError(f"tests/{seen[item.path]}::{item.name}: {why} (see tests/README.md)")


@pytest.hookimpl(tryfirst=True)   # before pytest-xdist reads the groups (its hook turns them into node ids)
def pytest_collection_modifyitems(config, items):
    # Under pytest-xdist (`--dist loadgroup`, scripts/test.sh) the slow end-to-end tests that start a Ray cluster of
    # their own run in one queue, on one worker, one at a time (two clusters starting at once on 2 loaded cores can
    # time out). Every other test, those that join the worker's running cluster (`ray_cluster`, one per worker)
    # included, goes to whichever worker is free. xdist hands out the largest group first, so the queue starts at
    # once and the other worker takes the rest meanwhile.
    refuse_misplaced(items)
    for item in items:
        mark_ray(item)
        if "e2e" in item.keywords and "slow" in item.keywords and starts_own_ray(item):
            item.add_marker(pytest.mark.xdist_group("slow-ray"))
    skip_cluster(items)
    if helpers.loopback_only() or os.environ.get("DUALRUN_TEST_ANY_NETWORK") == "1":
        return
    skip = pytest.mark.skip(reason="starts torchrun/Ray: run inside `unshare -n` with lo up (see CONTRIBUTING.md)")
    for item in items:
        if "e2e" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny() -> Path:
    """The tiny model, teacher, tokenizer and datasets (examples/make_tiny_model.py), built once for the whole run
    (cached by the builder's content: see helpers.tiny_assets). Read-only: a test that needs the files under its own
    path (a leftover marker, a relative `tiny/...`) links them with `helpers.link_tiny`, or takes `module_tiny`."""
    return helpers.tiny_assets()


@pytest.fixture(scope="module")
def module_tiny(tiny, tmp_path_factory) -> Path:
    """The shared assets under a path of this module's own: that path on the servers' command lines marks this
    module's processes, so its leftover checks never see another module's."""
    return helpers.link_tiny(tiny, tmp_path_factory.mktemp("assets"))


@pytest.fixture(scope="session")
def vllm_tiny() -> Path:
    """A student and a teacher vLLM can serve (head size 32), built once (helpers.tiny_assets)."""
    return helpers.tiny_assets(vllm=True)


@pytest.fixture(scope="session")
def ray_cluster():
    """One running local Ray cluster per test worker (one node, 8 logical CPUs, no GPUs), for the end-to-end tests
    that need *a* cluster, not a fresh one: `dualrun launch --backend ray` with its RAY_ADDRESS joins it, as on a
    real cluster, instead of each job starting and stopping an embedded one (~5-30 s each on 2 cores). The embedded
    path keeps its own tests (test_ray_backend.py, test_cli.py's README command). A test that uses it checks that
    its job left no actor and no placement group (`ray_cluster.assert_nothing_left()`): one worker's tests run one at
    a time, so whatever is left on its cluster is the test's own."""
    from ray_helpers import FakeGpuCluster

    cluster = FakeGpuCluster(nodes=1, gpus=0, cpus=8)
    yield cluster
    cluster.shutdown()


@pytest.fixture
def ray_cluster_if_ray(request, backend):
    """For a test parametrized by `backend`: this worker's running cluster (`ray_cluster`) in its "ray" case, None in
    its "torchrun" case, which then starts no cluster at all. Asked for by name, so the queue rule above
    (`starts_own_ray`) sees that the Ray case only joins the running cluster."""
    return request.getfixturevalue("ray_cluster") if backend == "ray" else None


@pytest.fixture
def write(tmp_path):
    """write('name.yaml', text) -> path"""

    def _write(name: str, text: str) -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    return _write


@pytest.fixture(scope="session")
def sft_one_machine(tiny, tmp_path_factory) -> list[float]:
    """The cluster tier's reference: TRL's sft.py with 2 ranks on one machine (tests/support/cluster_jobs.py), its
    losses; the same job across torchrun machines and across Ray nodes must give them. Run once per session."""
    import cluster_jobs

    work = tmp_path_factory.mktemp("sft-one-machine")
    data = cluster_jobs.sft_data(tiny, work)
    cluster_jobs.one_machine(work, cluster_jobs.SFT_CONFIG, cluster_jobs.sft_args(tiny, data, work / "out"))
    found = cluster_jobs.losses(work / "out")
    assert len(found) == 3, found
    return found


@pytest.fixture(scope="session")
def gkd_one_machine(tiny, tmp_path_factory) -> list[list[float]]:
    """The cluster tier's reference for GKD: the probe's job with a teacher of two CPU-engine replicas, all on one
    machine; each rank's losses."""
    import cluster_jobs

    work = tmp_path_factory.mktemp("gkd-one-machine")
    (work / "out").mkdir()
    cluster_jobs.one_machine(work, cluster_jobs.gkd_config(tiny), cluster_jobs.gkd_args(tiny, work / "out"))
    return [cluster_jobs.gkd_losses(work / "out", r) for r in (0, 1)]


@pytest.fixture(scope="session")
def grpo_one_machine(vllm_tiny, tmp_path_factory):
    """The vLLM tier's reference GRPO run: the probe's job (tests/support/vllm_helpers.py `grpo_job`: one trainer, one
    vLLM CPU engine in vLLM's own processes) on torchrun on one machine, run once per session: test_vllm_rollout.py
    compares its other layouts with it, test_vllm_cluster_ray.py the same job across Ray nodes."""
    from vllm_helpers import ProbeRun, run_grpo_probe

    work = tmp_path_factory.mktemp("grpo-one-machine")
    return ProbeRun(*run_grpo_probe(work, vllm_tiny, "torchrun", None, processes=True), work)
