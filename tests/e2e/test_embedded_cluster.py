"""The embedded Ray cluster holds every actor of its job's plan (dualrun/backends/ray/bundles.py), and a plan that
a cluster cannot hold at once is refused before anything waits on a placement.

The job: GKD on CPU with 2 trainers and a 2-replica CPU-engine teacher, whose plan is 2 ranks, 2 engine replicas and
a router: 5 actors of 1 CPU each. With no running cluster it trains on the cluster dualrun starts, and a replica
killed mid-training is restarted there while the job goes on."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from dualrun.config import build_config
from dualrun.config.load import load_config
from dualrun.contract.errors import ConfigError
from dualrun.backends.ray.bundles import check_fits, embedded_cpus
from dualrun.plan.placement import Cluster, Node
from dualrun.plan.processes import make_plan
from helpers import ASSETS, dualrun, eventually, pids_matching
from ray_helpers import ray_env
from test_replicas_e2e import _back, _losses, _replica_pid


def _gkd_yaml(teacher: str, replicas: int = 2, extra: str = "") -> str:
    return (f"use_cpu: true\nmethod: gkd\nlog_dir: logs\n{extra}roles:\n  train: {{gpus: 2}}\n"
            f"  teacher: {{gpus: {replicas}, model: {teacher}, top_k: 5, engine: transformers, "
            "health_timeout_s: 120}\n")


def test_the_embedded_cluster_is_sized_for_every_actor_of_the_plan(tmp_path):
    cases = {"gkd2": (_gkd_yaml("t"), 5),                        # 2 ranks + 2 engine replicas + 1 router
             "gkd1": (_gkd_yaml("t", replicas=1), 3),            # 2 ranks + 1 engine
             "gkd3_half": (_gkd_yaml("t", 3, "ray: {num_cpus_per_worker: 0.5}\n"), 5),   # 1 + 3 x 1 + 0.5 -> 5
             "sft": ("use_cpu: true\nroles: {train: {gpus: 2}}\n", 2),
             # 2 ranks + 1 engine + 2 spares (the fleet grows to max_replicas at once) + 1 router
             "fleet": (_gkd_yaml("t", 1).replace("engine: transformers", "engine: transformers, max_replicas: 3"), 6)}
    for name, (text, cpus) in cases.items():
        (tmp_path / f"{name}.yaml").write_text(text)
        assert embedded_cpus(load_config(str(tmp_path / f"{name}.yaml"), backend="ray")) == cpus, name


def test_a_plan_the_cluster_cannot_hold_at_once_is_refused_with_the_numbers():
    cfg = build_config(yaml.safe_load(_gkd_yaml("t")), "gkd.yaml", backend="ray")
    small = Cluster((Node(0, "127.0.0.1", 0, 3.0),), source="ray")
    with pytest.raises(ConfigError) as refused:
        check_fits(make_plan(cfg, small))
    assert refused.value.exit_code == 2
    assert str(refused.value) == ("gkd.yaml: ray.num_cpus_per_worker: expected at most 3 CPUs held at once by the "
                                  "plan's actors (the Ray cluster has 3 in 1 node(s)), got 5 (the plan: 2 train "
                                  "ranks, 2 teacher servers, 1 teacher router)")
    check_fits(make_plan(cfg, Cluster((Node(0, "127.0.0.1", 0, 5.0),), source="ray")))   # 5 fit


@pytest.mark.slow
@pytest.mark.e2e
def test_a_running_cluster_too_small_for_the_plan_is_refused_before_any_placement(tmp_path, ray_cluster, tiny):
    """This worker's running cluster has 8 CPUs: 5 ranks, 3 teacher replicas and a router of 1 CPU each can never be
    there at once, though each role's placement group alone would fit."""
    (tmp_path / "big.yaml").write_text(_gkd_yaml(str(tiny / "teacher"), replicas=3).replace("{gpus: 2}", "{gpus: 5}")
                                       + "ray: {placement_timeout_s: 60}\n")
    (tmp_path / "t.py").write_text("print('ran')\n")
    start = time.monotonic()
    proc = dualrun("launch", "--backend", "ray", "--config_file", "big.yaml", "t.py", cwd=tmp_path,
                   env=ray_env(RAY_ADDRESS=ray_cluster.address), timeout=200)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert time.monotonic() - start < 50
    line = proc.stderr.strip().splitlines()[-1]
    assert line == ("dualrun: error: big.yaml: ray.num_cpus_per_worker: expected at most 8 CPUs held at once by the "
                    "plan's actors (the Ray cluster has 8 in 1 node(s)), got 9 (the plan: 5 train ranks, 3 teacher "
                    "servers, 1 teacher router)"), line
    assert "ran" not in proc.stdout and not (tmp_path / "logs").exists()
    assert not ray_cluster.live_placement_groups()



@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.e2e
def test_a_refused_plan_releases_the_ray_connection_of_the_python_api(tmp_path, ray_cluster, tiny):
    """`dualrun.launch` in a long-lived Python process: the plan refused on the live cluster raises the one-line
    error, and the process holds no Ray connection afterwards (a retry with a smaller plan starts clean)."""
    (tmp_path / "big.yaml").write_text(_gkd_yaml(str(tiny / "teacher"), replicas=3).replace("{gpus: 2}", "{gpus: 5}"))
    (tmp_path / "t.py").write_text("print('ran')\n")
    script = ("import ray, dualrun\nfrom dualrun.contract.errors import ConfigError\n"
              "try:\n    dualrun.launch('t.py', config='big.yaml', backend='ray')\n"
              "except ConfigError as e:\n    print('refused:', e)\n"
              "print('connected:', ray.is_initialized())\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=200,
                          env=dict(os.environ, **ray_env(RAY_ADDRESS=ray_cluster.address)))
    out = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and out[0].startswith("refused: big.yaml: ray.num_cpus_per_worker: expected at most "
                                                      "8 CPUs"), proc.stdout + proc.stderr[-3000:]
    assert out[1:] == ["connected: False"], out   # nothing ran
    assert not ray_cluster.live_placement_groups()


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_gkd_with_a_replicated_cpu_teacher_trains_on_the_embedded_cluster_and_survives_a_killed_replica(
        tmp_path, tiny):
    """No running cluster (an empty RAY_ADDRESS, a private RAY_TMPDIR): dualrun starts one for the job. A short
    placement timeout: a cluster too small for the plan fails the job within it instead of training."""
    steps = 4
    (tmp_path / "job.yaml").write_text(_gkd_yaml(str(tiny / "teacher"), extra="ray: {placement_timeout_s: 30}\n"))
    (tmp_path / "out").mkdir()
    hold = tmp_path / "hold"
    hold.touch()
    env = dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1", **ray_env(RAY_ADDRESS=""))
    with open(tmp_path / "stderr.txt", "w") as errors:
        driver = subprocess.Popen([sys.executable, "-m", "dualrun", "launch", "--backend", "ray", "--config_file",
                                   "job.yaml", str(ASSETS / "gkd_probe.py"), "--model_name_or_path",
                                   str(tiny / "model"), "--teacher_model_name_or_path", str(tiny / "teacher"),
                                   "--data", str(tiny / "data" / "gkd.jsonl"), "--output_dir", "out", "--max_steps",
                                   str(steps), "--hold_file", str(hold), "--hold_at_step", "2"],
                                  cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=errors, text=True,
                                  start_new_session=True)
    stderr = lambda: (tmp_path / "stderr.txt").read_text()  # noqa: E731
    try:
        held = [tmp_path / f"hold.held{rank}" for rank in (0, 1)]   # both trainers at step 2, scored by the teacher
        assert eventually(lambda: driver.poll() is not None or all(h.exists() for h in held), timeout=480), \
            stderr()[-3000:]
        assert driver.poll() is None, stderr()[-3000:]
        os.kill(_replica_pid(tmp_path, 1), signal.SIGKILL)
        assert _back(tmp_path, driver, 1, timeout=150), stderr()[-3000:]
        hold.unlink()
        code = driver.wait(timeout=150)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
    err = stderr()
    assert code == 0, err[-3000:]
    assert "dualrun: teacher server 1 is back in rotation" in err and "restarting the job" not in err
    assert len(_losses(tmp_path, steps)) == steps
    assert eventually(lambda: not pids_matching(str(tmp_path), open_files=True), timeout=30)
