"""The SLURM backend's pure parts added with its config section and GPUs: the `slurm:` section's checks and
`#SBATCH` lines, the batch script's GPUs and CPUs per node from the plan, each step's GPUs (the plan's share as
positions, mapped by the task through what SLURM gave the step), and an unset num_machines inside an allocation.
No SLURM needed (real jobs: tests/e2e/test_slurm_backend.py, tests/e2e/test_slurm_allocation.py)."""
from __future__ import annotations

import json
import os

import pytest

from helpers import dualrun
from dualrun.backends.slurm.allocation import node_count
from dualrun.backends.slurm.steps import device_positions
from dualrun.backends.slurm.submit import Shape, batch_script, shape_of
from dualrun.backends.slurm.task import DEVICES, env_for, on_given
from dualrun.config.load import build_config
from dualrun.contract.errors import ConfigError
from dualrun.plan.processes import make_plan

NO_SLURM = {k: "" for k in os.environ if k.startswith("SLURM_")}
IN_JOB = {"SLURM_JOB_ID": "77", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "n[0-1]"}
GKD = {"method": "gkd", "roles": {"train": {"gpus": 4}, "teacher": {"gpus": 2, "model": "t", "top_k": 5}}}


def load(raw: dict, environ: dict | None = None, backend: str = "slurm"):
    return build_config(raw, "c.yaml", backend=backend, environ=environ or {})


def test_the_slurm_section_becomes_sbatch_lines():
    cfg = load({"use_cpu": True, "slurm": {"time": "1-02:00:00", "partition": "gpu,debug", "account": "a1",
                                           "qos": "high", "extra": ["--exclusive", "--mem=0"]}})
    text = batch_script(["python", "-m", "dualrun", "launch"], "/w", Shape(2, 4, 4, 2), "n", "/w/o-%j.out",
                        make_plan(cfg).rendezvous.options)
    sbatch = [ln for ln in text.splitlines() if ln.startswith("#SBATCH")]
    assert sbatch == ["#SBATCH --job-name=n", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4",
                      "#SBATCH --cpus-per-task=2", "#SBATCH --output=/w/o-%j.out", "#SBATCH --gpus-per-node=4",
                      "#SBATCH --time=1-02:00:00", "#SBATCH --partition=gpu,debug", "#SBATCH --account=a1",
                      "#SBATCH --qos=high", "#SBATCH --exclusive", "#SBATCH --mem=0"]
    assert "--time" not in batch_script(["x"], "/w", Shape(1, 1, 0), "n", "o", load({"use_cpu": True})
                                        .sections["slurm"])


@pytest.mark.parametrize("section, line", [
    ({"tme": "1"}, "slurm.tme: expected a known `slurm` key, got an unknown key (did you mean 'time'?)"),
    ({"time": 3600}, "slurm.time: expected a string or null, got 3600"),
    ({"time": "1 hour"}, "slurm.time: expected a SLURM time limit like '30' (minutes), '1:00:00' or '2-00:00:00'"),
    ({"partition": "a b"}, "slurm.partition: expected a SLURM name"),
    ({"extra": "--exclusive"}, "slurm.extra: expected a list"),
    ({"extra": ["exclusive"]}, "slurm.extra[0]: expected an sbatch option on one line"),
    ({"extra": ["--x\n#SBATCH --y"]}, "slurm.extra[0]: expected an sbatch option on one line"),
    ({"extra": ["--time=10"]}, "slurm.extra[0]: expected an option dualrun does not write itself (--time: use "
                               "slurm.time)"),
    ({"extra": ["-N", "2"]}, "slurm.extra[0]: expected an option dualrun does not write itself (--nodes: use the plan"),
])
def test_every_slurm_key_is_checked_one_line_naming_it(section, line):
    with pytest.raises(ConfigError) as e:
        load({"use_cpu": True, "slurm": section})
    assert str(e.value).startswith(f"c.yaml: {line}") and "\n" not in str(e.value), str(e.value)


def test_the_slurm_section_with_another_backend_is_checked_and_unread(tmp_path):
    """One file serves every backend (as `ray:` and `torchrun:` do): checked, read by SLURM alone."""
    cfg = load({"use_cpu": True, "slurm": {"time": "10"}}, backend="torchrun")
    assert make_plan(cfg).rendezvous.options == cfg.torchrun
    with pytest.raises(ConfigError, match="slurm.time"):
        load({"use_cpu": True, "slurm": {"time": "soon"}}, backend="ray")
    (tmp_path / "c.yaml").write_text("use_cpu: true\nslurm: {tme: 1}\n")
    r = dualrun("plan", "--backend", "torchrun", "--config_file", "c.yaml", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "slurm.tme" in r.stderr, r.stderr


def test_the_batch_scripts_gpus_and_cpus_per_node_come_from_the_plan():
    two = make_plan(load({**GKD, "num_machines": 2}))   # 2 ranks a node; the teacher's 2 engines (+ router) on node 0
    assert shape_of(two) == Shape(nodes=2, tasks_per_node=2, gpus_per_node=4, cpus_per_task=3)
    assert shape_of(make_plan(load({"use_cpu": True, "roles": {"train": {"gpus": 2}}}))) == Shape(1, 2, 0, 1)


def test_an_unset_num_machines_is_the_allocations_node_count():
    assert node_count(IN_JOB) == 2 and node_count({"SLURM_JOB_ID": "1", "SLURM_NNODES": "3"}) == 3
    assert node_count({"SLURM_JOB_NUM_NODES": "2"}) is None and node_count({"SLURM_JOB_ID": "1"}) is None
    cfg = load({"use_cpu": True, "roles": {"train": {"gpus": 4}}}, IN_JOB)
    assert cfg.num_machines == 2 and cfg.machines_from == "the 2 node(s) of SLURM job 77"
    assert load({"use_cpu": True, "num_machines": 1}, IN_JOB).num_machines == 1
    assert load({"use_cpu": True}, IN_JOB, backend="torchrun").num_machines == 1


def test_outside_an_allocation_plan_says_it_planned_one_node(tmp_path):
    (tmp_path / "c.yaml").write_text("use_cpu: true\nroles: {train: {gpus: 2}}\n")
    r = dualrun("plan", "--backend", "slurm", "--config_file", "c.yaml", cwd=tmp_path, env=NO_SLURM)
    assert r.returncode == 0 and "# num_machines unset and outside an allocation: planned on 1 node" in r.stdout
    (tmp_path / "c.yaml").write_text("use_cpu: true\nnum_machines: 2\nroles: {train: {gpus: 2}}\n")
    r = dualrun("plan", "--backend", "slurm", "--config_file", "c.yaml", cwd=tmp_path, env=NO_SLURM)
    assert r.returncode == 0 and "num_machines unset" not in r.stdout and "--nodes=2" in r.stdout, r.stdout


def test_each_steps_gpus_are_the_plans_share_of_what_slurm_gave_it(monkeypatch):
    assert device_positions("4,5", (2, 3, 4, 5, 6, 7)) == "2,3" and device_positions("1", range(4)) == "1"
    assert device_positions(None, range(2)) is None and device_positions("", range(2)) == ""
    assert on_given("2,3", "4,5,6,7") == "6,7" and on_given("0,1", None) == "0,1" and on_given("", "4,5") == ""
    with pytest.raises(ValueError, match="ask salloc/sbatch for more GPUs"):
        on_given("0,2", "4,5")
    from dualrun.backends.slurm import BACKEND
    from dualrun.launchers.launcher import Program
    from dualrun.methods.plugin import get_plugin

    for k in NO_SLURM:
        monkeypatch.delenv(k)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,4,5,6,7")   # the batch step's GPUs, as SLURM set them
    cfg = load(GKD, {})
    plan = make_plan(cfg, method=get_plugin(cfg.method, cfg.source), environ=os.environ)
    launcher = BACKEND.launcher(cfg, Program("SCRIPT"), None)
    ranks = launcher.prepare(plan).env
    assert ranks[DEVICES] == '["0,1,2,3"]' and ranks["CUDA_VISIBLE_DEVICES"] == "2,3,4,5,6,7"
    teacher = [p for p in plan.servers if p.kind == "server"]
    assert [launcher.positions(plan, p) for p in teacher] == ["4", "5"]
    # in a task of the ranks' step on a node where SLURM gave the step GPUs 1,3,5,7,9,11: the first four
    task = {**ranks, "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_STEP_NUM_TASKS": "4",
            "SLURM_STEP_TASKS_PER_NODE": "4", "MASTER_ADDR": "n0", "CUDA_VISIBLE_DEVICES": "1,3,5,7,9,11"}
    assert env_for(task)["CUDA_VISIBLE_DEVICES"] == "1,3,5,7" and env_for(task)["LOCAL_RANK"] == "1"
    server = {DEVICES: json.dumps([launcher.positions(plan, teacher[1])]), "CUDA_VISIBLE_DEVICES": "1,3,5,7,9,11"}
    assert env_for(server) == {"CUDA_VISIBLE_DEVICES": "11"}
