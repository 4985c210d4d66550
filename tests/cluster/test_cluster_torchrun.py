"""torchrun by hand across two machines of the virtual cluster (tests/support/vcluster.py), each with its own address:
the accelerate recipe of examples/multi-node/torchrun-by-hand, `dualrun launch --num_machines 2 --machine_rank K
--main_process_ip 192.168.77.1` on each machine. TRL's own scripts/sft.py, unchanged, gives the losses of one machine
with the same world size; a GKD job whose teacher has a CPU-engine replica on each machine serves through machine 0's
router, which reaches machine 1's replica at machine 1's address, with the losses of one machine. Only the output
directory and the tiny assets are shared between the machines (their /tmp is their own), as on machines with a shared
filesystem. Machine 1's /etc/hosts is Debian's (its name on 127.0.1.1): no GLOO_SOCKET_IFNAME is set anywhere, so the
jobs train only because dualrun gives gloo the interface of each machine's route to machine 0; a `lo` the user left
in GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME is refused on both machines before anything starts."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from cluster_jobs import (ENV, SFT_CONFIG, debian_hosts, gkd_args, gkd_config, launch_on, losses, outputs, sft_args,
                          sft_data, wait_all)
from helpers import eventually, pids_matching
from vcluster import VCluster, address

pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.slow]

MAIN = address(0)


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shared")


@pytest.fixture(scope="module")
def vc(shared, tiny):
    with VCluster(2, shared=[shared, tiny.parent]) as cluster:
        debian_hosts(cluster, 1)
        yield cluster


def on_machines(vc: VCluster, work: Path, config: str, argv: list[str], timeout_s: float) -> list[str]:
    """`dualrun launch --config_file job.yaml --num_machines 2 --machine_rank K --main_process_ip 192.168.77.1 ARGV` on
    each machine K, in work/mK (its job.yaml: `config` with MACHINE replaced by K, e.g. a log_dir of its own; its
    output in work/mK/out); each one's output once both have ended (what is left after `timeout_s` is killed: a hung
    machine must not outlive the test)."""
    procs = launch_on(vc, work, argv, config)
    wait_all(procs, timeout_s)
    outs = outputs(work)
    assert [p.returncode for p in procs] == [0, 0], [o[-3000:] for o in outs]
    return outs


def test_trl_sft_across_two_machines_gives_the_losses_of_one(vc, shared, tiny, sft_one_machine):
    work = shared / "sft"
    data = sft_data(tiny, work)
    outs = on_machines(vc, work, SFT_CONFIG, sft_args(tiny, data, work / "two"), 300)
    assert f"node 0 {MAIN} (this machine)" in outs[0] and "job succeeded" in outs[1]
    assert "dualrun: GLOO_SOCKET_IFNAME=eth0 for this machine's processes: eth0 holds " + address(1) in outs[1]
    assert losses(work / "two") == sft_one_machine
    assert (work / "two" / "model.safetensors").exists()


def test_gkd_teacher_replicas_on_both_machines_behind_machine_0s_router(vc, shared, tiny, gkd_one_machine):
    """Both machines' ranks get the router's address (machine 0's), the router reaches machine 1's replica at
    machine 1's address, each replica answers scoring requests, the losses are one machine's, and nothing is left on
    either machine."""
    work = shared / "gkd"
    work.mkdir()
    config = gkd_config(tiny, f"torchrun: {{gpus_per_machine: 2}}\nlog_dir: {work / 'logsMACHINE'}\n")
    outs = on_machines(vc, work, config, gkd_args(tiny, work / "out"), 300)
    ranks = [json.loads((work / "out" / f"rank{r}.json").read_text()) for r in (0, 1)]
    router = ranks[0]["teacher_address"]
    assert router == ranks[1]["teacher_address"] and router.startswith(f"{MAIN}:"), ranks
    assert re.search(rf"dualrun: teacher server 1: server healthy at {re.escape(address(1))}:\d+ \(machine 1\)",
                     outs[1]), outs[1][-2000:]
    router_log = (work / "logs0" / "teacher-router.log").read_text()
    replicas = re.search(r"serving http://0\.0\.0\.0:\d+ for 2 replicas: (\S+) (\S+)\n", router_log)
    assert replicas and [a.rpartition(":")[0] for a in replicas.groups()] == [MAIN, address(1)], router_log
    spread = re.search(r"served per replica: \[(\d+), (\d+)\]", router_log)
    assert spread and all(int(n) >= 1 for n in spread.groups()), router_log[-500:]
    served = [(work / f"logs{m}" / f"teacher-server-{m}.log").read_text().count('"POST /v1/completions') for m in (0, 1)]
    assert all(n >= 1 for n in served), served
    assert [r["losses"] for r in ranks] == gkd_one_machine and all(len(r["losses"]) == 2 for r in ranks)
    assert eventually(lambda: not pids_matching(str(tiny / "teacher"))), pids_matching(str(tiny / "teacher"))


def test_the_recipes_virtual_cluster_lines_run_as_written(vc, shared, tiny):
    """examples/multi-node/torchrun-by-hand/README.md, "Try it on a virtual cluster": its lines after the cluster's
    start, in a shell beside this test's cluster (its pids in VCLUSTER_PIDS, as the README's first command sets
    them), only the paths changed to this test's own: both checks pass, then both machines train."""
    from doc_recipes import one_machine_block, run_block, substitute

    work = shared / "readme"
    work.mkdir()
    lines = one_machine_block("torchrun-by-hand", "## Try it on a virtual cluster")
    assert lines[0].startswith("python examples/make_tiny_model.py --out /tmp/tiny")
    assert lines[1].startswith("python tests/support/vcluster.py --machines 2 --share /tmp/tiny -- bash")
    link = work / "tiny"
    link.symlink_to(tiny, target_is_directory=True)
    cmds = substitute(lines[2:], {"/tmp/tiny/out": str(work / "out"), "/tmp/tiny": str(link)})
    proc = run_block(cmds, timeout=280, env={"VCLUSTER_PIDS": f"{vc.pid(0)},{vc.pid(1)}",
                                             "VCLUSTER_SWITCH": str(vc.switch[1]), **ENV})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("dualrun check: 2 node(s) ready for backend=torchrun") == 2, proc.stdout[-3000:]
    state = json.loads((work / "out" / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and proc.stderr.count("job succeeded") == 2, proc.stderr[-3000:]


def test_a_teacher_placed_on_machine_1_serves_both_machines_ranks(vc, shared, tiny, gkd_one_machine):
    """`roles.teacher.machines: [1]`: the teacher's one CPU-engine server runs on machine 1 alone (machine 0 starts
    none), every rank of both machines scores against it at machine 1's address, with the losses of one machine."""
    work = shared / "gkd-machine-1"
    work.mkdir()
    config = gkd_config(tiny, f"log_dir: {work / 'logsMACHINE'}\n").replace("teacher: {gpus: 2,",
                                                                             "teacher: {gpus: 1, machines: [1],")
    outs = on_machines(vc, work, config, gkd_args(tiny, work / "out"), 300)
    ranks = [json.loads((work / "out" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert {r["teacher_address"].rpartition(":")[0] for r in ranks} == {address(1)}, ranks
    assert re.search(rf"dualrun: teacher server 0: server healthy at {re.escape(address(1))}:\d+ \(machine 1\)",
                     outs[1]), outs[1][-2000:]
    assert not (work / "logs0" / "teacher-server-0.log").exists()
    assert (work / "logs1" / "teacher-server-0.log").read_text().count('"POST /v1/completions') >= 2
    assert [r["losses"] for r in ranks] == gkd_one_machine


@pytest.mark.parametrize("variable", ["GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"])
def test_a_loopback_interface_left_exported_is_refused_on_both_machines_in_seconds(vc, shared, tiny, variable):
    """`GLOO_SOCKET_IFNAME=lo` (or NCCL's) left exported from a one-machine recipe (issue 49): gloo would advertise
    127.0.0.1, and the job failed naming another cause after a minute, or hung. Each machine refuses on its own,
    before anything starts: exit 2, one line naming the variable, the interface and why."""
    work = shared / f"loopback-{variable}"
    work.mkdir()
    data = sft_data(tiny, work)
    start = time.monotonic()
    procs = launch_on(vc, work, sft_args(tiny, data, work / "out"), SFT_CONFIG, env={variable: "lo"})
    wait_all(procs, 60)
    took = time.monotonic() - start
    outs = outputs(work)
    assert [p.returncode for p in procs] == [2, 2], [o[-2000:] for o in outs]
    for k, out in enumerate(outs):
        assert out.strip().splitlines()[-1] == (
            f"dualrun: error: {variable}=lo names lo (127.0.0.1), a loopback interface: on a job across machines "
            "(num_machines 2) the other machines cannot reach it, and the job would hang or fail in its first "
            "collective; unset it (dualrun then gives gloo eth0, the interface the other machines reach this one at) "
            "or name that interface (set in the launching shell)"), out[-2000:]
    assert took < 30, took
    assert not (work / "out").exists()
