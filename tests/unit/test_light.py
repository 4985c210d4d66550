"""dualrun.light holds the standard-library-only modules a Ray worker, a role worker or a server process imports
before (and without) torch or Ray; the worker half of a method plugin is found without the driver half.

Why a test in a fresh interpreter: an import of torch, Ray, transformers or yaml at the top of one of these modules
costs every Ray worker and server seconds of start-up, and nothing else would notice."""
from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import dualrun.light
from dualrun.rank.method import worker_half

HEAVY = ("torch", "ray", "transformers", "trl", "accelerate", "datasets", "deepspeed", "vllm", "numpy", "yaml")


def _imported_by(modules: list[str]) -> list[str]:
    """sys.modules after importing `modules` in a fresh interpreter."""
    code = (f"import sys, importlib\nfor m in {modules!r}: importlib.import_module(m)\n"
            "import json; print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    return json.loads(out.stdout)


def test_the_light_modules_import_nothing_heavy_and_no_other_dualrun_module():
    light = [f"dualrun.light.{m.name}" for m in pkgutil.iter_modules(dualrun.light.__path__)]
    assert {"dualrun.light.ports", "dualrun.light.child_process", "dualrun.light.progress"} <= set(light)
    loaded = _imported_by(light)
    assert set(light) <= set(loaded), "the probe imported nothing: it is broken"
    assert sorted(m for m in loaded if m.split(".")[0] in HEAVY) == []
    assert sorted(m for m in loaded if m.startswith("dualrun") and m not in ("dualrun", "dualrun.light")
                  and not m.startswith("dualrun.light.")) == []


def test_the_probe_sees_a_heavy_import():
    assert "yaml" in _imported_by(["yaml"])


def test_a_worker_activates_a_plugin_without_its_driver_half():
    """rank/bootstrap.py's path: the worker half of gkd (which imports grpo's) and nothing of the config, the
    driver halves or the servers' command lines."""
    loaded = _imported_by(["dualrun.rank.method", "dualrun.plugins.workers.gkd_worker"])
    driver = [m for m in loaded if m.startswith(("dualrun.config", "dualrun.programs",
                                                 "dualrun.servers", "dualrun.plan.processes", "dualrun.launchers"))
              or m in ("dualrun.methods.plugin", "dualrun.plugins.gkd", "dualrun.plugins.grpo")]
    assert driver == []
    assert sorted(m for m in loaded if m.split(".")[0] in HEAVY) == []


def test_the_worker_half_of_each_method():
    assert worker_half("grpo").__name__ == "dualrun.plugins.workers.grpo_worker"
    assert worker_half("gkd").__name__ == "dualrun.plugins.workers.gkd_worker"
    assert worker_half("sft") is None and worker_half("sampling") is None and worker_half("pt") is None
    assert worker_half("workers") is None and worker_half("_x") is None
