"""docs/troubleshooting.md's dualrun lines are what dualrun prints (issue 48): each entry names its proof in a
`<!-- proof: NAME -->` comment, and the real run of that name (a launch or a check on loopback, the scenario of the
test that covers the behaviour) must print every line the entry quotes, placeholders matched as regexes
(tests/support/troubleshooting_doc.py). An entry without a proof here, in a tier test (`EXTERNAL`), or an honest "does
not catch", fails; so does a proof whose entry is gone. The scenarios run at once in one fixture: most of their time
is waiting out a short bound (a rendezvous of 5 s, a health check of 3 s)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

import troubleshooting_doc as doc
from dualrun.light.ports import free_ports
from helpers import REPO
from ray_helpers import ray_env

# proofs that run in another tier (the virtual cluster: two machines of their own): the test file that calls
# troubleshooting_doc.says(NAME, ...) on its own run's output
EXTERNAL = {"weight-sync-0000": "tests/cluster/test_cluster_check.py"}
RAY = {"ray-pending"}   # below, on this worker's running Ray cluster

SFT2 = "use_cpu: true\nroles: {train: {gpus: 2}}\n"
WAIT = "import time\ntime.sleep(120)\n"


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "dualrun", *args]


def _two_machines(rank: int, port: int) -> list[str]:
    return ["--num_machines", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
            "--main_process_port", str(port)]


# Each scenario: (files to write, command, env), in a directory of its own. The same faults as
# tests/e2e/test_taken_port.py, test_cluster_faults.py (machine 1 never started, machine 0 not there: here both
# "machines" on loopback), test_loopback_interfaces.py, test_cluster_check.py (an interface machine 1 lacks),
# test_check_weight_sync.py (a member that cannot form the group) and test_separate_torchrun.py.
Scenario = Callable[[int], tuple[dict[str, str], list[str], dict[str, str]]]
SCENARIOS: dict[str, Scenario] = {
    "port-taken": lambda port: ({"job.yaml": SFT2 + f"main_process_port: {port}\n", "s.py": "print('ran')\n"},
                                _cli("launch", "--config_file", "job.yaml", "s.py"), {}),
    "machine-never-joins": lambda port: (
        {"job.yaml": SFT2 + "torchrun: {rendezvous_timeout_s: 5}\n", "s.py": "print('ran')\n"},
        _cli("launch", "--config_file", "job.yaml", *_two_machines(0, port), "s.py"), {}),
    "machine-0-not-there": lambda port: (
        {"job.yaml": SFT2 + "torchrun: {rendezvous_timeout_s: 5}\n", "s.py": "print('ran')\n"},
        _cli("launch", "--config_file", "job.yaml", *_two_machines(1, port), "s.py"), {}),
    "loopback-interface": lambda port: (
        {"job.yaml": SFT2, "s.py": "print('ran')\n"},
        _cli("launch", "--config_file", "job.yaml", "--backend", "ray", "--num_machines", "2", "--dry_run", "s.py"),
        {"GLOO_SOCKET_IFNAME": "lo", **ray_env()}),
    "missing-interface": lambda port: (
        {"job.yaml": SFT2}, _cli("check", "--config_file", "job.yaml", *_two_machines(1, port), "--wait_s", "5"),
        {"GLOO_SOCKET_IFNAME": "ens5"}),
    "weight-sync-hangs": lambda port: (
        {"job.yaml": "method: grpo\nroles:\n  train: {gpus: 1}\n  rollout: {gpus: 1, model: m, env: "
                     "{GLOO_SOCKET_IFNAME: nosuch0}}\n"},
        _cli("check", "--config_file", "job.yaml"), {}),
    "server-never-healthy": lambda port: (
        {"job.yaml": "use_cpu: true\nmethod: gkd\nroles:\n  train: {gpus: 1}\n  teacher: {gpus: 1, model: teacher, "
                     "top_k: 5, health_timeout_s: 3, server_args: [--startup-delay, 60]}\n", "wait.py": WAIT},
        _cli("launch", "--config_file", "job.yaml", "wait.py"), {}),
}


# -- the doc and its proofs, without running anything ----------------------------------------------------------------
def test_every_entry_has_a_proof_and_every_proof_an_entry():
    entries = doc.entries()
    assert len(entries) >= 10, [e.heading for e in entries]
    proofs = [e.proof for e in entries if e.proof != doc.NONE]
    assert len(proofs) == len(set(proofs)), proofs
    for e in entries:
        assert e.proof, f"{e.heading!r}: no <!-- proof: NAME --> comment"
        if e.proof == doc.NONE:
            assert e.says_nothing and not e.lines, f"{e.heading!r}: proof none, but it quotes a dualrun line"
        else:
            assert e.lines and not e.says_nothing, f"{e.heading!r}: no dualrun line under **dualrun says**"
            assert e.proof in {*SCENARIOS, *EXTERNAL, *RAY}, f"{e.heading!r}: no test produces {e.proof!r}"
    assert {*SCENARIOS, *EXTERNAL, *RAY} <= set(proofs), "a proof whose entry is gone"
    for name, path in EXTERNAL.items():
        assert f'says("{name}"' in (REPO / path).read_text(), f"{path} does not prove {name!r}"


def test_placeholders_match_what_varies_and_nothing_else():
    line = "dualrun: error: machine <K> did not join within <N> s (<WHY>); <...> at <ADDR>:<PORT>"
    assert doc.pattern(line).fullmatch("dualrun: error: machine 1 did not join within 2.5 s (late); x at 10.0.0.1:29500")
    assert not doc.pattern(line).fullmatch("dualrun: error: machine one did not join within 2.5 s (late); x at a:1")
    assert not doc.pattern(line).fullmatch("dualrun: error: machine 1 did not join within 5 s (late); at a:1 more")
    assert doc.unmatched(["a <N> b", "c"], "  a 12 b\nd\n") == ["c"]


def test_an_entry_that_says_nothing_quotes_nothing():
    text = ("# T\n## Caught\n<!-- proof: x -->\n**dualrun says** (then):\n\n```text\nline <N>\n```\n\n**Fix:** f\n"
            "## Not caught\n<!-- proof: none -->\n```text\ntheirs\n```\n**dualrun says:** nothing; dualrun does not "
            "catch this.\n\n**Fix:** f\n")
    caught, not_caught = doc.entries(text)
    assert (caught.heading, caught.proof, caught.lines, caught.says_nothing) == ("Caught", "x", ("line <N>",), False)
    assert (not_caught.proof, not_caught.lines, not_caught.says_nothing) == ("none", (), True)


# -- the real runs -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, str]:
    """Every scenario's output (stdout and stderr), all started at once; the port of port-taken held meanwhile."""
    procs = {}
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        ports = dict(zip(SCENARIOS, free_ports(len(SCENARIOS))), **{"port-taken": held.getsockname()[1]})
        for name, scenario in SCENARIOS.items():
            where = tmp_path_factory.mktemp(name)
            files, argv, env = scenario(ports[name])
            for file, text in files.items():
                (where / file).write_text(text)
            procs[name] = subprocess.Popen(argv, cwd=where, env={**os.environ, **env}, stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT, text=True)
        return {name: p.communicate(timeout=240)[0] for name, p in procs.items()}


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("proof", sorted(SCENARIOS))
def test_the_doc_quotes_what_dualrun_prints(outputs, proof):
    doc.says(proof, outputs[proof])


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ray_pending_for_resources(tmp_path, ray_cluster):
    """As tests/e2e/test_ray_backend.py's unplaceable group: 3 workers spread strictly over this worker's one node."""
    (tmp_path / "job.yaml").write_text("use_cpu: true\nroles: {train: {gpus: 3}}\n"
                                       "ray: {placement_strategy: STRICT_SPREAD, placement_timeout_s: 3}\n")
    (tmp_path / "s.py").write_text("print('ran')\n")
    proc = subprocess.run(_cli("launch", "--backend", "ray", "--config_file", "job.yaml", "s.py"), cwd=tmp_path,
                          env={**os.environ, **ray_env(RAY_ADDRESS=ray_cluster.address)}, capture_output=True,
                          text=True, timeout=100)
    assert proc.returncode == 2, proc.stderr[-3000:]
    doc.says("ray-pending", proc.stderr)
    ray_cluster.assert_nothing_left()
