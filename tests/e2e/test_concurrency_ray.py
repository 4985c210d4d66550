"""Three Ray jobs started at once against one running cluster never collide (unique actor and placement-group
names, ports picked free), and each cleans up after itself. Repeated to shake out races."""
from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import eventually
from ray_helpers import ray_env

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400), pytest.mark.slow, pytest.mark.ray]

QUICK = """
import os, sys, pathlib, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
pathlib.Path(sys.argv[1], f"done{dist.get_rank()}").write_text(os.environ["MASTER_PORT"] + " " + str(t.item()))
dist.destroy_process_group()
"""


def test_three_jobs_at_once(tmp_path, ray_cluster):
    cluster = ray_cluster   # this worker's running cluster (conftest): 8 CPUs, the three jobs take 6
    (tmp_path / "quick.py").write_text(QUICK)
    (tmp_path / "c.yaml").write_text("use_cpu: true\nroles: {train: {gpus: 2}}\nray: {placement_timeout_s: 120}\n")
    env = dict(__import__("os").environ, **ray_env(RAY_ADDRESS=cluster.address))
    for attempt in range(2):
        outs = [tmp_path / f"a{attempt}j{j}" for j in range(3)]
        for o in outs:
            o.mkdir()
        procs = [subprocess.Popen([sys.executable, "-m", "dualrun", "launch", "--backend", "ray", "--config_file",
                                   "c.yaml", "quick.py", str(o)], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True) for o in outs]
        errs = [p.communicate(timeout=300)[1] for p in procs]
        assert [p.returncode for p in procs] == [0, 0, 0], [e[-1500:] for e in errs]
        ports = set()
        for o in outs:
            r0, r1 = (o / "done0").read_text(), (o / "done1").read_text()
            assert r0 == r1 and r0.endswith(" 2.0")
            ports.add(r0.split()[0])
        assert len(ports) == 3, "each job has its own master port"
    assert eventually(lambda: not cluster.alive_actors()), cluster.alive_actors()
    assert eventually(lambda: not cluster.live_placement_groups()), cluster.live_placement_groups()
