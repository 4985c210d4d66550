"""The embedded cluster dualrun starts is lean: what the job does not use is not running (log monitor,
autoscaler monitor), what it uses is (GCS, raylet, runtime-env agent, the dashboard agent the raylet needs), and a
`runtime_env` (working_dir, env_vars) and placement groups still work on it."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile

import pytest

from helpers import REPO
from helpers import gone

# the driver: dualrun's connect starts the cluster; a task in a placement group imports a module that only the
# working_dir ships and reads an env var of the runtime_env; then the kinds of this process's descendants
DRIVER = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
from ray_idle_cost import kind_of, tree_ticks
import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from dualrun.config.model import RayOptions
from dualrun.backends.ray.connect import LEAN_ENV, connect

before = {k: os.environ.get(k) for k in LEAN_ENV}
opts = RayOptions(address="local", runtime_env={"working_dir": sys.argv[2], "env_vars": {"LEAN_TEST": "shipped"}})
conn = connect(opts, "test", num_cpus=2)
pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="PACK")
ray.get(pg.ready(), timeout=120)

@ray.remote(num_cpus=1)
def probe():
    import shipped_mod
    return shipped_mod.VALUE, os.environ.get("LEAN_TEST"), os.nice(0)

got = ray.get(probe.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 1)).remote(), timeout=120)
tree = tree_ticks(os.getpid())
kinds = sorted({kind_of(cmd, p == os.getpid()) for p, (_, cmd) in tree.items()})
env_kept = {k: os.environ.get(k) for k in LEAN_ENV} == before
minimal = any("dashboard/agent.py" in cmd and "--minimal" in cmd for _, cmd in tree.values())   # the raylet's
# command line holds the agent's
deps = "ray.dashboard.optional_deps" in sys.modules
conn.close()
print("RESULT " + json.dumps({"got": got, "kinds": kinds, "pids": [p for p in tree if p != os.getpid()],
                              "env_kept": env_kept, "minimal": minimal, "deps": deps}))
"""


@pytest.mark.e2e
@pytest.mark.ray
@pytest.mark.slow      # ~15 s on 2 busy cores: an embedded cluster, a runtime_env, one task
@pytest.mark.timeout(240)
def test_embedded_cluster_runs_only_what_the_job_uses_and_runtime_env_still_works(tmp_path):
    shipped = tmp_path / "wd"
    shipped.mkdir()
    (shipped / "shipped_mod.py").write_text("VALUE = 'from working_dir'\n")
    env = dict(os.environ, RAY_ADDRESS="", RAY_TMPDIR=tempfile.mkdtemp(prefix="drl", dir="/tmp"),
               PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, "-c", DRIVER, str(REPO / "benchmarks"), str(shipped)], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=200)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    assert res.returncode == 0 and lines, res.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["got"] == ["from working_dir", "shipped", 0]   # working_dir and env_vars reached the task, which
    # runs at normal priority (Ray's workers run at niceness 15 by default)
    kinds = set(out["kinds"])
    assert {"GCS", "raylet", "runtime-env agent", "dashboard agent"} <= kinds, kinds
    # turned off: the job does not use them (the API server serves only usage stats without the dashboard)
    assert not {"log monitor", "autoscaler monitor", "API server"} & kinds, kinds
    assert out["env_kept"]            # the lean defaults reached Ray's processes, not the driver's own environment
    # the dashboard agent in Ray's minimal mode, chosen without the dashboard's packages imported here
    assert out["minimal"] and not out["deps"], out
    assert all(gone(p) for p in out["pids"]), [p for p in out["pids"] if not gone(p)]   # close stopped them all


def test_lean_node_params_apply_only_inside_the_init_and_the_env_comes_back(monkeypatch):
    from ray._private import parameter

    rc = importlib.import_module("dualrun.backends.ray.connect")   # the package's `connect` is the function

    monkeypatch.delenv("REPORTER_UPDATE_INTERVAL_MS", raising=False)
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "1")   # the user's choice wins over the lean default
    from ray._private import node, utils

    original, dependency_error = parameter.RayParams, utils.get_dashboard_dependency_error
    api_server = node.Node.start_api_server
    with pytest.raises(RuntimeError):
        with rc.lean_node() as kwargs:
            assert kwargs == {"_system_config": rc.LEAN_SYSTEM_CONFIG}
            assert isinstance(utils.get_dashboard_dependency_error(), ImportError)   # Ray's minimal mode
            params = parameter.RayParams()
            assert (params.include_log_monitor, params.no_monitor) == (False, True)
            assert os.environ["REPORTER_UPDATE_INTERVAL_MS"] == rc.LEAN_ENV["REPORTER_UPDATE_INTERVAL_MS"]
            assert os.environ["RAY_USAGE_STATS_ENABLED"] == "1"
            raise RuntimeError("ray.init failed")
    assert parameter.RayParams is original and utils.get_dashboard_dependency_error is dependency_error
    assert node.Node.start_api_server is api_server
    assert "REPORTER_UPDATE_INTERVAL_MS" not in os.environ and os.environ["RAY_USAGE_STATS_ENABLED"] == "1"


def test_idle_cost_names_processes_and_tables_cores_per_kind():
    """benchmarks/ray_idle_cost.py's pure parts: the process names the e2e test above relies on, and the table
    (cores = CPU seconds / window; a kind a variant does not run is '–', not 0)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import ray_idle_cost as ric

    assert ric.kind_of("/x/python -u /x/ray/_private/log_monitor.py --session-dir=/t", False) == "log monitor"
    assert ric.kind_of("ray::DashboardAgent", False) == "dashboard agent"
    assert ric.kind_of("/x/ray/core/src/ray/raylet/raylet --raylet_socket_name=/t", False) == "raylet"
    assert ric.kind_of("anything", True) == "driver"

    def run(variant, **cpu):
        return {"variant": variant, "window_s": 10.0, "start_s": 1.0, "load": [1.0, 1.0, 1.0],
                "procs": [{"kind": k.replace("_", " "), "cpu_s": s} for k, s in cpu.items()]}

    runs = [run("embedded-before", raylet=0.1, log_monitor=0.05, idle_actors=0.2),
            run("embedded-dualrun", raylet=0.1, idle_actors=0.2)]
    rows = {line.split(" | ")[0].strip("| "): line for line in ric.table(runs).splitlines()}
    assert rows["log monitor"].endswith("| 0.005 (0.005–0.005) | – |")
    assert "| **0.035 (0.035–0.035)** | **0.030 (0.030–0.030)** |" in rows["**all**"]
    assert rows["Ray's daemons (all but actors and driver)"].endswith("| 0.015 (0.015–0.015) | 0.010 (0.010–0.010) |")
