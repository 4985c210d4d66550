"""Job-level behaviour on a real two-node Ray cluster (fake GPUs, one per node, each node with its own TMPDIR as on
separate machines): `dualrun.launch(fn)` ships the call and its results through the actors, and Ctrl-C while Ray
places a server returns within 10 s and leaves nothing behind."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from helpers import eventually
from ray_helpers import FakeGpuCluster, ray_env

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180), pytest.mark.slow, pytest.mark.ray]

CALL = """
import json, os, sys
import dualrun

def where():
    # sys.argv of the worker: [bootstrap, '--call', FILE]: FILE must be on the worker's own node
    return {"rank": int(os.environ["RANK"]), "call_file": sys.argv[2]}

result = dualrun.launch(where, config={"backend": "ray", "roles": {"train": {"gpus": 2}},
                                       "ray": {"address": sys.argv[1]}})
print("RESULT " + json.dumps({"ok": result.ok, "message": result.message,
                              "values": [r.result for r in result.ranks]}), flush=True)
"""


@pytest.fixture(scope="module")
def node_tmps():
    dirs = [tempfile.mkdtemp(prefix=f"drnode{i}", dir="/tmp") for i in range(2)]
    yield dirs
    import shutil

    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(node_tmps):
    c = FakeGpuCluster(nodes=2, gpus=1, cpus=2, node_tmpdirs=node_tmps)
    yield c
    c.shutdown()


def test_launch_fn_ships_the_call_and_results_through_the_actors(tmp_path, cluster, node_tmps):
    (tmp_path / "call.py").write_text(CALL)
    driver_tmp = tmp_path / "driver-tmp"
    driver_tmp.mkdir()
    env = dict(os.environ, **ray_env(TMPDIR=str(driver_tmp)))
    proc = subprocess.run([sys.executable, "call.py", cluster.address], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert out["ok"], out
    values = out["values"]
    assert [v["rank"] for v in values] == [0, 1]
    # the call was read from each rank's own node (its actor's temp dir), never from the driver's temp folder
    homes = {next((d for d in node_tmps if v["call_file"].startswith(d + os.sep)), None) for v in values}
    assert homes == set(node_tmps), ([v["call_file"] for v in values], node_tmps)
    assert not list(driver_tmp.rglob("*.result.*"))


def test_ctrl_c_while_ray_places_a_server_returns_within_10_s(tmp_path, cluster):
    """Every GPU is held by someone else: the teacher's placement waits (timeout 120 s); SIGINT ends it now."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    holder = placement_group([{"GPU": 1}, {"GPU": 1}], strategy="SPREAD")
    ray.get(holder.ready(), timeout=30)
    try:
        (tmp_path / "job.yaml").write_text(
            "method: gkd\nray: {placement_timeout_s: 120}\n"
            "roles:\n  train: {gpus: 1}\n  teacher: {gpus: 1, model: /nonexistent-model, top_k: 5}\n")
        (tmp_path / "t.py").write_text("print('never runs')\n")
        env = dict(os.environ, **ray_env(RAY_ADDRESS=cluster.address))
        driver = subprocess.Popen([sys.executable, "-m", "dualrun", "launch", "--backend", "ray", "--config_file",
                                   "job.yaml", "t.py"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)

        def pending_server() -> bool:
            return any("-server-" in (p.get("name") or "") and p.get("state") == "PENDING"
                       for p in ray.util.placement_group_table().values())

        assert eventually(pending_server, timeout=60), driver.poll()
        time.sleep(1.0)
        sent = time.monotonic()
        driver.send_signal(signal.SIGINT)
        code = driver.wait(timeout=30)
        took = time.monotonic() - sent
        err = driver.stderr.read()
        assert code == 130, err[-2000:]
        assert took < 10, f"{took:.1f} s"
        assert "stopped by SIGINT" in err and "Traceback" not in err
        assert eventually(lambda: not [p for p in cluster.live_placement_groups()
                                       if p.get("placement_group_id") != holder.id.hex()])
    finally:
        remove_placement_group(holder)
