"""The SLURM recipes, run for real: a one-node SLURM cluster (munged, slurmctld, slurmd on 127.0.0.1), `sbatch`
of examples/multi-node/slurm/{torchrun,ray}.sbatch exactly as written, a tiny model trained by each.

Only the scripts' own knobs change (CPU config, processes per node, ports, output dir); `--nodes=1` and no GPUs
are given to sbatch, as a user overrides #SBATCH lines. SLURM is installed when missing (root; CI), else the
test is skipped with the reason."""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from helpers import REPO, free_port, pids_matching
from slurm_helpers import one_node_slurm
from doc_recipes import shell_env, stop_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
SLURM = REPO / "examples" / "multi-node" / "slurm"


@pytest.fixture(scope="module")
def slurm():
    with one_node_slurm("drs") as cluster:
        yield cluster


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", ["torchrun", "ray"])
def test_sbatch_recipe_trains(slurm, tiny, tmp_path, backend):
    ray_tmp = tempfile.mkdtemp(prefix="drs", dir="/tmp")
    out = tmp_path / "out"
    env = shell_env(MODEL=str(tiny / "model"), DATA=str(tiny / "data" / "sft.jsonl"), CONFIG="configs/sft_cpu.yaml",
                    NPROC_PER_NODE="2", GPUS_PER_NODE="0", OUT=str(out), TRAIN_ARGS="--max_steps 2",
                    PORT=str(free_port()), RAY_PORT=str(free_port()), RAY_TMPDIR=ray_tmp)
    try:
        code, log = slurm.sbatch(SLURM / f"{backend}.sbatch", "--nodes=1", "--gpus-per-node=0", "--cpus-per-task=2",
                                 env=env, cwd=REPO, timeout=800)
        assert code == 0, log[-5000:] + slurm.logs()
        state = json.loads((out / "trainer_state.json").read_text())
        assert state["global_step"] == 2 and "job succeeded" in log, log[-3000:]
        assert not pids_matching(ray_tmp, open_files=True), f"left running after the job: {pids_matching(ray_tmp, open_files=True)}"
    finally:
        stop_cluster(ray_tmp)
        shutil.rmtree(ray_tmp, ignore_errors=True)
