"""A role group's own process group, through `dualrun launch` on both backends: the two workers of `prm` (an
ms-swift `device_groups` config with nproc_per_node) are two processes with the group's RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT, and all-reduce; the group's items reach them by an ms-swift-signature dispatch. The
program runs once on both backends (a single controller): the group's two workers are the only two. On Ray the
config's `ray.runtime_env` reaches them."""
from __future__ import annotations

import json
import tempfile

import pytest

from helpers import ASSETS, dualrun

CONFIG = """\
method: sampling
use_cpu: true
mixed_precision: 'no'
ray: {address: local, runtime_env: {env_vars: {GROUP_TEST_FROM_RUNTIME_ENV: shipped}}}
device_groups:
  nproc_per_node: 2
  sample_group: {device: CPU, ranks: 1, workers: [sampler]}
  reward_group:
    device: CPU
    ranks: list(range(0, 2))
    workers: [prm]
"""


@pytest.mark.e2e
@pytest.mark.slow     # ~20 s each on 2 busy cores: torchrun (or a Ray cluster) plus two spawned workers
@pytest.mark.timeout(200)
@pytest.mark.parametrize("backend", ["torchrun", "ray"])
def test_a_two_worker_group_all_reduces_when_launched(backend, tmp_path):
    cfg = tmp_path / "groups.yaml"
    cfg.write_text(CONFIG)
    out = tmp_path / "out.json"
    env = {"RAY_ADDRESS": "", "RAY_TMPDIR": tempfile.mkdtemp(prefix="drg", dir="/tmp"), "OMP_NUM_THREADS": "1"}
    res = dualrun("launch", "--backend", backend, "--config_file", str(cfg),
                  str(ASSETS / "group_allreduce.py"), str(out), cwd=tmp_path, env=env, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    # the driver's exit stops the group's workers itself, before multiprocessing's exit handler (which would wait on
    # them until the exit guard gave up, 60 s later)
    assert "did not finish within" not in res.stderr, res.stderr[-3000:]
    got = json.loads(out.read_text())
    workers = got["results"]
    assert [(w["sum"], w["rank"], w["world"]) for w in workers] == [(3.0, 0, 2), (3.0, 1, 2)]
    assert [(w["RANK"], w["WORLD_SIZE"]) for w in workers] == [("0", "2"), ("1", "2")]
    assert len({(w["MASTER_ADDR"], w["MASTER_PORT"]) for w in workers}) == 1
    # Ray: the config's ray.runtime_env reaches the role's actors (torchrun has no runtime_env: local processes)
    assert [w["GROUP_TEST_FROM_RUNTIME_ENV"] for w in workers] == [("shipped" if backend == "ray" else None)] * 2
    assert len({w["pid"] for w in workers} | {got["pid"]}) == 3             # each worker its own process
    # the program ran once, as the driver (no torchrun rank of its own), so the group was started once
    assert (tmp_path / "out.json.runs").read_text().split() == [str(got["pid"])] and got["RANK"] is None
