"""`dualrun check`'s weight-sync handshake: the trainer's weight-sync group formed on the job's nodes, before any
model loads. The layout is pure (who joins, ranks, world size, where the port is picked); the handshake itself runs
real torch.distributed groups in real processes, and on two local Ray nodes through the real CLI."""
from __future__ import annotations

import re
import socket

import pytest

from helpers import dualrun
from dualrun.plan.meeting import rendezvous_of
from dualrun.config.load import build_config
from dualrun.methods.plugin import get_plugin
from dualrun.plan.processes import Cluster, make_plan
from dualrun.weightsync.sync_group import (Member, SyncGroup, advertised_address, node_host_env, port_host,
                                      sync_group)
from dualrun.weightsync.rehearsal import run_local, verdict
from ray_helpers import FakeGpuCluster, ray_env


GRPO = get_plugin("grpo")


def _cfg(roles: dict, **top) -> object:
    return build_config({"method": "grpo", "roles": roles, **top}, "job.yaml")


def test_the_group_is_trainer_rank_0_then_every_replica_from_its_rank_offset():
    cfg = _cfg({"train": {"gpus": 1}, "rollout": {"gpus": 4, "tensor_parallel_size": 2, "model": "m",
                                                  "env": {"GLOO_SOCKET_IFNAME": "eth1", "OTHER": "x"}}},
               backend="ray")
    group = sync_group(cfg, make_plan(cfg, Cluster.uniform(2, 4), method=GRPO))
    assert group is not None and group.world_size == 5 and group.gpus
    assert [(m.label, m.node, m.ranks, dict(m.env)) for m in group.members] == [
        ("trainer rank 0", 0, (0,), {}),
        ("rollout server 0", 0, (1, 2), {"GLOO_SOCKET_IFNAME": "eth1"}),   # 3 GPUs left on node 0: one replica
        ("rollout server 1", 1, (3, 4), {"GLOO_SOCKET_IFNAME": "eth1"})]
    assert [m.name for m in group.members] == ["trainer rank 0", "rollout server 0 (ranks 1-2)",
                                               "rollout server 1 (ranks 3-4)"]
    assert port_host(rendezvous_of(cfg)) == "0.0.0.0"                                      # as the Ray rank 0 actor picks it
    one = _cfg({"train": {"gpus": 1}, "rollout": {"gpus": 1, "model": "m"}})
    solo = sync_group(one, make_plan(one, method=GRPO))
    assert solo is not None and solo.world_size == 2 and [m.ranks for m in solo.members] == [(0,), (1,)]
    assert port_host(rendezvous_of(one)) == "127.0.0.1"                                    # one torchrun machine: loopback


@pytest.mark.parametrize("roles, top", [
    ({"train": {"gpus": 1}}, {}),                                                           # no rollout at all
    ({"train": {"gpus": 1}, "rollout": {"gpus": 1, "engine": "vllm"}},
     {"colocate_groups": [["train", "rollout"]]}),                                          # colocated: in-process
    ({"train": {"gpus": 1}, "rollout": {"address": "10.0.0.9:8000"}}, {}),                 # a server you run
    ({"train": {"gpus": 1}, "rollout": {"gpus": 1, "model": "m", "engine": "transformers"}}, {}),  # no endpoints
])
def test_no_weight_sync_no_group(roles, top):
    cfg = _cfg(roles, **top)
    assert sync_group(cfg, make_plan(cfg, method=GRPO)) is None


def test_the_method_says_which_roles_take_the_weights_not_the_role_name():
    """The group is the replicas of the roles the method's plugin names (`weight_roles`), on an engine that takes
    weights: a plugin naming none has no group for the same layout, and one naming the teacher rehearses it."""
    cfg = _cfg({"train": {"gpus": 1}, "teacher": {"gpus": 1, "model": "m", "top_k": 5}}, method="gkd")

    class TeacherTakesWeights:
        weight_roles = frozenset({"teacher"})

    assert sync_group(cfg, make_plan(cfg, method=get_plugin("gkd"))) is None
    group = sync_group(cfg, make_plan(cfg, method=TeacherTakesWeights()))
    assert group is not None and group.role == "teacher" and [m.name for m in group.members] == \
        ["trainer rank 0", "teacher server 0 (rank 1)"]
    rollout = _cfg({"train": {"gpus": 1}, "rollout": {"gpus": 1, "model": "m"}})
    assert sync_group(rollout, make_plan(rollout, method=None)) is None
    assert "VLLM_SERVER_DEV_MODE" not in make_plan(rollout).servers[0].env
    assert make_plan(rollout, method=GRPO).servers[0].env["VLLM_SERVER_DEV_MODE"] == "1"


def test_the_cause_is_reported_not_the_timeouts_it_caused():
    group = SyncGroup((Member("trainer rank 0", 0, (0,)),
                       Member("rollout server 0", 1, (1,), {"GLOO_SOCKET_IFNAME": "bad0"})), 2, False)
    names = {0: "node 0 10.0.0.1", 1: "node 1 10.0.0.2"}
    lines, notes = verdict(group, [{"ok": False, "timeout": True, "error": "wait timeout"},
                                   {"ok": False, "timeout": False, "backend": "gloo", "error": "Unable to find bad0"}],
                           names, "10.0.0.1", 4242)
    assert notes == [] and lines == ["weight sync (gloo, trainer rank 0 at 10.0.0.1:4242): node 1 10.0.0.2: "
                                      "rollout server 0 (rank 1) with GLOO_SOCKET_IFNAME=bad0: Unable to find bad0"]
    lines, notes = verdict(group, [{"ok": True, "backend": "gloo", "seconds": 0.25}, None], names, "10.0.0.1", 4242)
    assert notes == [] and lines == ["weight sync (gloo, trainer rank 0 at 10.0.0.1:4242): node 1 10.0.0.2: "
                                      "rollout server 0 (rank 1) with GLOO_SOCKET_IFNAME=bad0: stopped"]
    lines, notes = verdict(group, [{"ok": True, "backend": "gloo", "seconds": 0.25}, {"ok": True}], names,
                           "10.0.0.1", 4242)
    assert lines == [] and notes == ["weight sync: gloo group of 2 at 10.0.0.1:4242 (trainer rank 0 on node 0 "
                                     "10.0.0.1; rollout server 0 (rank 1) on node 1 10.0.0.2) moved a tensor in 0.25 s"]


def test_each_replica_s_rate_is_printed_beside_its_link_and_the_model_s_sync_time_estimated():
    """The payload's MB/s from its bytes and seconds (MB = 10^6 bytes), the link's Mb/s as the node reports it
    (none, or no interface found, said so), and the model's files over the slowest rate."""
    group = SyncGroup((Member("trainer rank 0", 0, (0,)), Member("rollout server 0", 1, (1,)),
                       Member("rollout server 1", 2, (2, 3))), 4, False)
    names = {0: "node 0 10.0.0.1", 1: "node 1 10.0.0.2", 2: "node 2 10.0.0.3"}
    mib64 = 64 * 2**20
    results = [{"ok": True, "backend": "gloo", "seconds": 0.31, "payload_bytes": mib64, "payload_s": 0.5},
               {"ok": True, "payload_bytes": mib64, "payload_s": 0.6, "link": {"interface": "eth0", "mbps": 1000}},
               {"ok": True, "payload_bytes": mib64, "payload_s": 1.2, "link": {"interface": "ib0", "mbps": None}}]
    lines, notes = verdict(group, results, names, "10.0.0.1", 4242, model_bytes=2_000_000_000)
    assert lines == [] and notes[1:] == [
        "weight sync: 64 MiB down the chain to rollout server 0 (rank 1) on node 1 10.0.0.2 in 0.60 s: 112 MB/s "
        "(link eth0: 1000 Mb/s = 125 MB/s)",
        "weight sync: 64 MiB down the chain to rollout server 1 (ranks 2-3) on node 2 10.0.0.3 in 1.20 s: 56 MB/s "
        "(link ib0: no speed reported)",
        "weight sync: the rollout model's files hold 2.00 GB: about 35.8 s a sync at the slowest replica's 56 MB/s "
        "(weights the trainer holds in a wider dtype than its files move more)"]
    results[2] = {"ok": True, "payload_bytes": mib64, "payload_s": 0.0}   # no payload figure: no line, no estimate
    results[1]["link"] = None
    _, notes = verdict(group, results, names, "10.0.0.1", 4242, model_bytes=5_000_000)
    assert notes[1:] == ["weight sync: 64 MiB down the chain to rollout server 0 (rank 1) on node 1 10.0.0.2 in "
                         "0.60 s: 112 MB/s (its link not found)",
                         "weight sync: the rollout model's files hold 5.0 MB: about 0.04 s a sync at the slowest "
                         "replica's 112 MB/s (weights the trainer holds in a wider dtype than its files move more)"]


def test_the_link_speed_is_read_where_linux_reports_one(tmp_path):
    from dualrun.weightsync.links import interface_of, interface_toward, speed_mbps

    for name, text in (("eth0", "10000\n"), ("veth1", "-1\n"), ("bad", "x")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "speed").write_text(text)
    assert speed_mbps("eth0", str(tmp_path)) == 10000
    assert speed_mbps("veth1", str(tmp_path)) is None and speed_mbps("bad", str(tmp_path)) is None
    assert speed_mbps("nosuch", str(tmp_path)) is None
    assert interface_toward("10.1.2.3", {"GLOO_SOCKET_IFNAME": "ens5,ens6"}) == "ens5"   # gloo's choice first
    assert interface_of("127.0.0.1") == "lo" and interface_toward("127.0.0.1", {}) == "lo"


def test_a_replica_that_timed_out_dialling_0000_is_told_to_set_vllm_host_ip():
    group = SyncGroup((Member("trainer rank 0", 0, (0,)), Member("rollout server 0", 1, (1,))), 2, False)
    lines, _ = verdict(group, [{"ok": False, "timeout": True, "error": "wait timeout"},
                               {"ok": False, "timeout": True, "error": "timed out connecting"}],
                       {0: "node 0 10.0.0.1", 1: "node 1 10.0.0.2"}, "0.0.0.0", 4242)
    assert len(lines) == 2 and lines[1] == (
        "weight sync (gloo, trainer rank 0 at 0.0.0.0:4242): node 1 10.0.0.2: rollout server 0 (rank 1): timed out "
        "connecting; trainer rank 0 advertises 0.0.0.0 (vLLM's get_ip() found no route out there): set VLLM_HOST_IP "
        "in roles.train.env to the address the engines reach it at")
    assert "VLLM_HOST_IP" not in lines[0]      # rank 0's own node reaches 0.0.0.0


def test_the_master_address_is_the_one_vllm_would_advertise():
    assert advertised_address({"VLLM_HOST_IP": "10.1.2.3", "HOST_IP": "10.9.9.9"}) == "10.1.2.3"
    assert advertised_address({"HOST_IP": "10.9.9.9"}) != "10.9.9.9"   # vLLM's get_ip() ignores HOST_IP


def test_a_trainer_on_a_node_of_several_advertises_its_node_address_unless_the_user_chose_one():
    """A job across nodes: VLLM_HOST_IP = the node's address the others reach (its Ray address), so vLLM's
    get_ip() does not give the route-out interface's; not on one node, not over the user's own VLLM_HOST_IP."""
    assert node_host_env({}, "192.168.77.2") == {"VLLM_HOST_IP": "192.168.77.2"}
    assert node_host_env({"HOST_IP": "10.9.9.9"}, "192.168.77.2") == {"VLLM_HOST_IP": "192.168.77.2"}
    assert node_host_env({"VLLM_HOST_IP": "10.1.2.3"}, "192.168.77.2") == {}
    assert node_host_env({}, None) == {}
    assert advertised_address(node_host_env({}, "192.168.77.2")) == "192.168.77.2"


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_local_handshake_moves_a_tensor_then_names_a_taken_port():
    """The torchrun path (every member on this machine): real gloo groups in real processes, a replica holding
    two ranks; then the port held on rank 0's node, which the trainer could not listen on."""
    group = SyncGroup((Member("trainer rank 0", 0, (0,)), Member("rollout server 0", 0, (1, 2))), 3, False)
    names = {0: "node 0 (this machine)"}
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        lines, notes = run_local(group, "127.0.0.1", port, names, timeout_s=10)
        assert notes == [] and len(lines) == 1, lines
        assert lines[0].startswith(f"weight sync (gloo, trainer rank 0 at 127.0.0.1:{port}): node 0 (this machine):"
                                   " trainer rank 0: ") and "address already in use" in lines[0].lower(), lines
    lines, notes = run_local(group, "127.0.0.1", port, names, timeout_s=10, model_bytes=10**9)
    assert lines == [] and notes[0].startswith(f"weight sync: gloo group of 3 at 127.0.0.1:{port} (trainer rank 0 "
                                               "on node 0 (this machine); rollout server 0 (ranks 1-2) on node 0 "
                                               "(this machine)) moved a tensor in "), notes
    assert re.fullmatch(r"weight sync: 64 MiB down the chain to rollout server 0 \(ranks 1-2\) on node 0 \(this "
                        r"machine\) in [\d.]+ s: \d+ MB/s \(link lo: no speed reported\)", notes[1]), notes
    assert re.fullmatch(r"weight sync: the rollout model's files hold 1.00 GB: about [\d.]+ s a sync at the slowest "
                        r"replica's \d+ MB/s \(.*\)", notes[2]) and len(notes) == 3, notes


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_member_that_starts_later_than_the_bound_still_forms_the_group():
    """The group's bound counts from the moment every member's process is up, not from each one's start: on a
    loaded node (CI: load 10+ on 2 cores) a Ray task's worker and `import torch` start members tens of seconds
    apart. Here the replica starts 6 s after the trainer, whose bound is 3 s; a member that never comes is still
    a timeout within the start window."""
    import time

    from dualrun.light.ports import free_port
    from dualrun.weightsync.rehearsal import member_result, member_spec, start_member

    group = SyncGroup((Member("trainer rank 0", 0, (0,)), Member("rollout server 0", 0, (1,))), 2, False)
    port = free_port("127.0.0.1")
    specs = [{**member_spec(group, m, "127.0.0.1", port, timeout_s=3), "payload_bytes": 1024, "start_s": 30}
             for m in group.members]
    trainer = start_member(specs[0])
    time.sleep(6)
    replica = start_member(specs[1])
    results = [member_result(trainer, 60), member_result(replica, 60)]
    assert [r["ok"] for r in results] == [True, True], results
    alone = start_member({**specs[0], "port": free_port("127.0.0.1"), "start_s": 4})
    result = member_result(alone, 60)
    assert not result["ok"] and result["timeout"] and "1 of 2 ranks had started within" in result["error"], result


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_torchrun_check_runs_the_handshake_on_this_machine(tmp_path):
    """Through the CLI on torchrun: the replica's interface variable from its role env reaches its member. (No
    GPU here, so the plan's GPUs are a problem of their own: the check reports both and still forms the group.)"""
    (tmp_path / "job.yaml").write_text("method: grpo\nroles:\n  train: {gpus: 1}\n  rollout: {gpus: 1, model: m, "
                                       "env: {GLOO_SOCKET_IFNAME: nosuch0}}\n")
    proc = dualrun("check", "--config_file", "job.yaml", cwd=tmp_path)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 2, proc.stdout + proc.stderr
    assert lines[0] == "dualrun check: node 0 (this machine): the plan puts 2 GPU(s) there, it has 0", lines
    assert re.fullmatch(r"dualrun check: weight sync \(gloo, trainer rank 0 at [\d.]+:\d+\): node 0 \(this machine\): "
                        r"rollout server 0 \(rank 1\) with GLOO_SOCKET_IFNAME=nosuch0: Unable to find address for: "
                        r"nosuch0 \(after [\d.]+ s\)", lines[1]), lines


@pytest.fixture(scope="module")
def two_nodes():
    cluster = FakeGpuCluster(nodes=2, gpus=1, cpus=1)
    yield cluster
    cluster.shutdown()


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(300)
def test_ray_check_forms_the_weight_sync_group_across_two_nodes(tmp_path, two_nodes):
    """Trainer rank 0 on node 0, the rollout replica on node 1 (one fake GPU each; no CUDA, so gloo): the
    handshake reports its time; the replica's role env naming an interface its node lacks is one line with exit
    code 1, naming the node, the interface and trainer rank 0's address and port."""
    job = "backend: ray\nmethod: grpo\nray: {{address: '{}'}}\nroles:\n  train: {{gpus: 1}}\n" \
          "  rollout: {{gpus: 1, model: m{}}}\n"
    (tmp_path / "ok.yaml").write_text(job.format(two_nodes.address, ""))
    ok = dualrun("check", "--config_file", "ok.yaml", cwd=tmp_path, env=ray_env(), timeout=200)
    lines = ok.stdout.strip().splitlines()
    assert ok.returncode == 0, ok.stdout + ok.stderr
    sync = [ln for ln in lines if "weight sync" in ln and "MiB down the chain" not in ln]   # the payload's apart
    assert len(sync) == 1 and sync[0].startswith("dualrun check: weight sync: gloo group of 2 at ") and (
        "(trainer rank 0 on node 0 127.0.0.1; rollout server 0 (rank 1) on node 1 127.0.0.1) moved a tensor in "
        in sync[0]), lines
    (tmp_path / "bad.yaml").write_text(job.format(two_nodes.address, ", env: {GLOO_SOCKET_IFNAME: nosuch0}"))
    bad = dualrun("check", "--config_file", "bad.yaml", cwd=tmp_path, env=ray_env(), timeout=200)
    lines = bad.stdout.strip().splitlines()
    assert bad.returncode == 1 and len(lines) == 1, bad.stdout + bad.stderr
    assert lines[0].startswith("dualrun check: weight sync (gloo, trainer rank 0 at ") and \
        ": node 1 127.0.0.1: rollout server 0 (rank 1) with GLOO_SOCKET_IFNAME=nosuch0: Unable to find address for: " \
        "nosuch0" in lines[0], lines
    two_nodes.assert_nothing_left()


def test_the_payload_goes_down_the_chain_and_a_changed_byte_is_caught():
    """The probe's payload over real gloo (three ranks in threads): every rank reports the seconds it took."""
    import threading
    from datetime import timedelta

    from torch.distributed import HashStore

    from dualrun.weightsync.probe import check_payload, join, payload

    store, out = HashStore(), {}

    def run(rank: int) -> None:
        out[rank] = join(store, rank, 3, "gloo", 0, timedelta(seconds=30), payload_bytes=3 * 2**20 + 7)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(out) == [0, 1, 2] and all(got == [0.0, 1.0, 2.0, 3.0] and s > 0 for got, s in out.values()), out
    data = payload(10_000)
    check_payload(data)
    data[4099] += 1
    with pytest.raises(RuntimeError, match="the payload arrived changed"):
        check_payload(data)


def test_the_model_s_bytes_are_its_weight_files_where_the_model_is_a_local_directory(tmp_path):
    from dualrun.check.preflight import model_file_bytes

    (tmp_path / "model-00001.safetensors").write_bytes(b"x" * 300)
    (tmp_path / "model-00002.safetensors").write_bytes(b"x" * 200)
    (tmp_path / "pytorch_model.bin").write_bytes(b"x" * 7)          # safetensors first, as loaders take them
    (tmp_path / "config.json").write_text("{}")
    roles = {"train": {"gpus": 1}, "rollout": {"gpus": 1, "model": str(tmp_path)}}
    assert model_file_bytes(_cfg(roles), "rollout") == 500
    assert model_file_bytes(_cfg({**roles, "rollout": {"gpus": 1, "model": "org/hub-name"}}), "rollout") is None
    assert model_file_bytes(_cfg({"train": {"gpus": 1}}), "rollout") is None
