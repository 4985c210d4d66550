"""No process group is destroyed while a rank's program runs (dualrun/rank/keep_groups.py).

The deadlock it prevents, made deterministic: a DDP model freed after `destroy_process_group()` (a script's `main()`
returning after TRL's `trainer.end()`) frees the group's last reference from its Reducer with the GIL held, while a
gloo worker thread is still in a gather whose handle and outputs the program dropped; when the gather ends, the worker
needs the GIL to free those tensors, and the main thread, joining that worker, never lets go of it. Here the peer
rank joins the gather 3 s late, so the worker is always still in it when the model is freed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import pytest

from helpers import pids_matching
from ray_helpers import ray_env

pytestmark = pytest.mark.timeout(300)

# torch._dynamo is imported before the group is made, as importing TRL or transformers does: a DDP model then holds
# its group's last reference once the group is destroyed (torch 2.13)
DEADLOCK = r"""
import os, time
import torch._dynamo
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DistributedDataParallel(torch.nn.Linear(4, 4))
    model(torch.ones(2, 4)).sum().backward()
    if rank == 1:
        time.sleep(3)
    outs = [torch.empty(4) for _ in range(dist.get_world_size())]
    dist.all_gather(outs, torch.ones(4), async_op=True)
    del outs
    dist.destroy_process_group()


main()
print("rank", os.environ["RANK"], "returned from main", flush=True)
"""

# one process: are the group's gloo worker threads still there once the group is destroyed and its DDP model freed?
KEPT = r"""
import gc, os, sys, tempfile
import torch._dynamo
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def gloo_workers():
    names = []
    for t in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{t}/comm") as f:
            names.append(f.read().strip())
    return names.count("pt_gloo_runloop")


dist.init_process_group("gloo", init_method="file://" + os.path.join(tempfile.mkdtemp(), "s"), rank=0, world_size=1)
side = dist.new_group([0])
model = DistributedDataParallel(torch.nn.Linear(4, 4))
before = gloo_workers()
dist.destroy_process_group(side)
dist.destroy_process_group()
del model, side
gc.collect()
print("gloo workers", before, gloo_workers(), flush=True)
"""


def test_destroyed_groups_and_a_freed_ddp_models_group_stay_alive_until_the_rank_exits(tmp_path):
    (tmp_path / "kept.py").write_text(KEPT)
    proc = subprocess.run([sys.executable, "-m", "dualrun.rank.bootstrap", "kept.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("gloo workers"))
    before, after = map(int, line.split()[2:])
    # none joined (a thread that names itself late, on a loaded machine, may be counted only after)
    assert before >= 2 and after >= before, line


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["torchrun", "ray"])
def test_a_ddp_model_freed_after_destroy_process_group_does_not_deadlock(tmp_path, backend, ray_cluster_if_ray):
    address = ray_cluster_if_ray.address if ray_cluster_if_ray else ""
    script = tmp_path / "deadlock.py"   # its path on the ranks' command lines marks them for the clean-up below
    script.write_text(DEADLOCK)
    (tmp_path / "cpu2.yaml").write_text("use_cpu: true\nroles: {train: {gpus: 2}}\n")
    env = dict(os.environ, **ray_env(RAY_ADDRESS=address))
    log = tmp_path / "launch.log"
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "dualrun", "launch", "--backend", backend, "--config_file",
                                 "cpu2.yaml", str(script)], cwd=tmp_path, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=150)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            for pid in pids_matching(str(script)):   # a deadlocked rank cannot act on its launcher's death
                os.kill(pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"the job hung: a rank deadlocked freeing its DDP model\n{log.read_text()[-3000:]}")
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} returned from main" in text
    assert "did not finish" not in text and "did not return" not in text   # the exit guard had nothing to do
    assert time.monotonic() - start < 150
