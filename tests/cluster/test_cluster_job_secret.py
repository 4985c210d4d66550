"""Who may reach a job's servers across two machines of the virtual cluster, where they listen on every address:
torchrun by hand, a GKD job whose teacher has a CPU-engine replica on each machine behind machine 0's router, held
after step 1.
- `DUALRUN_JOB_TOKEN` set to the same value on both machines: from machine 1, a client without the secret, or with
  a guessed one, is refused (401 / 403) the router's replica control (take a replica out, point it elsewhere) and
  machine 1's replica's weight-sync endpoint;
- no `DUALRUN_JOB_TOKEN` anywhere: machine 0 makes the secret and hands it to machine 1 through its store; from a
  third machine that is not in the job (vc2), the same requests to machine 1's replica and machine 0's router are
  refused, and one with the secret machine 1's replica got is answered.
Either way the router's table stays as it was, the job trains with the losses of one machine, and the secret is in
no output or log."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from cluster_jobs import gkd_args, gkd_config, launch_on, outputs, wait_all
from dualrun.contract import protocol
from dualrun.contract.job_token import HEADER
from helpers import eventually, pids_matching
from vcluster import VCluster, address

pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.slow]

SECRET = "shared-job-secret-of-both-machines"

# From a machine of the cluster: each (method, url, body, headers) -> the status it got.
CLIENT = """
import json, sys, urllib.error, urllib.request
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
out = []
for method, url, body, headers in json.loads(sys.argv[1]):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json", **headers})
    try:
        with opener.open(req, timeout=30) as r:
            out.append([r.status, json.loads(r.read() or b"null")])
    except urllib.error.HTTPError as e:
        out.append([e.code, None])
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shared")


@pytest.fixture(scope="module")
def vc(shared, tiny):
    with VCluster(3, shared=[shared, tiny.parent]) as cluster:   # vc2: a machine outside the jobs
        yield cluster


def _from_machine(vc: VCluster, machine: int, calls: list) -> list:
    proc = vc.run(machine, [sys.executable, "-c", CLIENT, json.dumps(calls)], timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_shared_secret_guards_both_machines_servers(vc, shared, tiny, gkd_one_machine):
    work = shared / "secret"
    work.mkdir()
    hold = work / "hold"
    hold.touch()
    config = gkd_config(tiny, f"torchrun: {{gpus_per_machine: 2}}\nlog_dir: {work / 'logsMACHINE'}\n")
    procs = launch_on(vc, work, gkd_args(tiny, work / "out") + ["--hold_file", str(hold), "--hold_at_step", "1"],
                      config, env={"DUALRUN_JOB_TOKEN": SECRET})
    try:
        assert eventually(lambda: any(p.poll() is not None for p in procs) or all(
            Path(f"{hold}.held{r}").exists() for r in (0, 1)), timeout=240)
        assert all(p.poll() is None for p in procs), [(work / f"m{k}" / "out").read_text()[-2000:] for k in (0, 1)]
        router = re.search(r"dualrun: teacher: server healthy at (\S+)", (work / "m0" / "out").read_text()).group(1)
        replica = re.search(r"dualrun: teacher server 1: server healthy at (\S+) \(machine 1\)",
                            (work / "m1" / "out").read_text()).group(1)
        assert router.startswith(f"{address(0)}:") and replica.startswith(f"{address(1)}:")
        wrong = {HEADER: "a-guess"}
        calls = [["POST", f"http://{router}/router/replicas/1/remove", {"reason": "x"}, {}],
                 ["POST", f"http://{router}/router/replicas/1/remove", {"reason": "x"}, wrong],
                 ["POST", f"http://{router}/router/replicas/0/replace", {"address": f"{address(1)}:1"}, {}],
                 ["POST", f"http://{replica}/reset_prefix_cache", {}, {}],
                 ["POST", f"http://{replica}/reset_prefix_cache", {}, wrong],
                 ["GET", f"http://{router}/router/stats", None, {}]]
        *refused, (status, table) = _from_machine(vc, 1, calls)
        assert [code for code, _ in refused] == [401, 403, 401, 401, 403], refused
        assert status == 200 and table["in_rotation"] == [0, 1], table   # nothing taken out, nothing replaced
        assert [r["address"] for r in table["replicas"]][1] == replica, table
    finally:
        hold.unlink(missing_ok=True)
        wait_all(procs, 240)
    outs = outputs(work)
    assert [p.returncode for p in procs] == [0, 0], [o[-3000:] for o in outs]
    ranks = [json.loads((work / "out" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["losses"] for r in ranks] == gkd_one_machine
    logs = [f.read_text(errors="replace") for k in (0, 1) for f in (work / f"logs{k}").rglob("*") if f.is_file()]
    assert not any(SECRET in text for text in outs + logs)


def _env_of(pid: int) -> dict[str, str]:
    raw = open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace")
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def test_with_no_secret_set_machine_0_hands_its_own_to_machine_1(vc, shared, tiny, gkd_one_machine, monkeypatch):
    monkeypatch.delenv("DUALRUN_JOB_TOKEN", raising=False)
    work = shared / "handed"
    work.mkdir()
    hold = work / "hold"
    hold.touch()
    config = gkd_config(tiny, f"torchrun: {{gpus_per_machine: 2}}\nlog_dir: {work / 'logsMACHINE'}\n")
    procs = launch_on(vc, work, gkd_args(tiny, work / "out") + ["--hold_file", str(hold), "--hold_at_step", "1"],
                      config)
    try:
        assert eventually(lambda: any(p.poll() is not None for p in procs) or all(
            Path(f"{hold}.held{r}").exists() for r in (0, 1)), timeout=240)
        assert all(p.poll() is None for p in procs), [(work / f"m{k}" / "out").read_text()[-2000:] for k in (0, 1)]
        router = re.search(r"dualrun: teacher: server healthy at (\S+)", (work / "m0" / "out").read_text()).group(1)
        replica = re.search(r"dualrun: teacher server 1: server healthy at (\S+) \(machine 1\)",
                            (work / "m1" / "out").read_text()).group(1)
        assert router.startswith(f"{address(0)}:") and replica.startswith(f"{address(1)}:")
        # the secret each server got (this namespace sees every machine's processes)
        [replica_pid] = pids_matching("dualrun.programs.cpu_engine", f"--port {replica.rpartition(':')[2]} ")
        [router_pid] = pids_matching("dualrun.programs.router", f"--port {router.rpartition(':')[2]} ")
        secret = _env_of(replica_pid).get(protocol.JOB_TOKEN, "")
        assert len(secret) >= 40 and secret == _env_of(router_pid).get(protocol.JOB_TOKEN)
        wrong = {HEADER: "a-guess"}
        calls = [["POST", f"http://{replica}/reset_prefix_cache", {}, {}],
                 ["POST", f"http://{replica}/reset_prefix_cache", {}, wrong],
                 ["POST", f"http://{router}/router/replicas/1/remove", {"reason": "x"}, {}],
                 ["POST", f"http://{replica}/reset_prefix_cache", {}, {HEADER: secret}],
                 ["GET", f"http://{router}/router/stats", None, {}]]
        *refused, (ok, _), (status, table) = _from_machine(vc, 2, calls)
        assert [code for code, _ in refused] == [401, 403, 401], refused
        assert ok == 200 and status == 200 and table["in_rotation"] == [0, 1], table
    finally:
        hold.unlink(missing_ok=True)
        wait_all(procs, 240)
    outs = outputs(work)
    assert [p.returncode for p in procs] == [0, 0], [o[-3000:] for o in outs]
    ranks = [json.loads((work / "out" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["losses"] for r in ranks] == gkd_one_machine
    logs = [f.read_text(errors="replace") for k in (0, 1) for f in (work / f"logs{k}").rglob("*") if f.is_file()]
    assert not any(secret in text for text in outs + logs)
