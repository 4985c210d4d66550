"""An interface variable naming loopback on a job across machines is refused before anything starts (issue 49):
`GLOO_SOCKET_IFNAME=lo` left exported from a one-machine recipe made gloo advertise 127.0.0.1, and the job failed
naming another cause or hung. The pure rule (light/interfaces.py), the launcher's refusal (launchers/loopback.py),
and Ray's dry run across nodes; a one-machine job, or one whose machine 0 is this host's loopback, keeps it. The
refusal on two real machines is tests/cluster/test_cluster_faults.py's."""
from __future__ import annotations

import pytest

from helpers import dualrun
from dualrun.contract.errors import LaunchError
from dualrun.launchers.loopback import refuse_loopback
from dualrun.light.interfaces import Interface, loopback_named

ETH = {"lo": Interface("lo", "127.0.0.1", "unknown"), "eth0": Interface("eth0", "192.168.77.2", "up"),
       "dummy0": Interface("dummy0", "127.0.0.2", "unknown"), "lon0": Interface("lon0", "10.0.0.2", "up")}


@pytest.mark.parametrize("env, expected", [
    ({}, []),
    ({"GLOO_SOCKET_IFNAME": "eth0"}, []),
    ({"GLOO_SOCKET_IFNAME": "lo"}, [("GLOO_SOCKET_IFNAME", "lo", "lo")]),
    ({"GLOO_SOCKET_IFNAME": "eth0,lo"}, [("GLOO_SOCKET_IFNAME", "eth0,lo", "lo")]),   # gloo: a device per name
    ({"GLOO_SOCKET_IFNAME": "dummy0"}, [("GLOO_SOCKET_IFNAME", "dummy0", "dummy0")]),   # holds only 127.0.0.2
    ({"GLOO_SOCKET_IFNAME": "lon0"}, []),
    ({"TP_SOCKET_IFNAME": "lo"}, [("TP_SOCKET_IFNAME", "lo", "lo")]),
    ({"TP_SOCKET_IFNAME": "eth0,lo"}, []),                          # TensorPipe takes the first name only
    ({"NCCL_SOCKET_IFNAME": "lo"}, [("NCCL_SOCKET_IFNAME", "lo", "lo")]),   # a prefix matching lo
    ({"NCCL_SOCKET_IFNAME": "=lo"}, [("NCCL_SOCKET_IFNAME", "=lo", "lo")]),
    ({"NCCL_SOCKET_IFNAME": "eth"}, []),
    ({"NCCL_SOCKET_IFNAME": "^lo,docker"}, []),                     # an exclusion list
    ({"NCCL_SOCKET_IFNAME": "=lon0"}, []),
    ({"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "lo"}, [("NCCL_SOCKET_IFNAME", "lo", "lo")]),
])
def test_which_variables_put_a_transport_on_loopback(env, expected):
    assert loopback_named(env, ETH) == expected


def test_without_an_interface_table_lo_is_still_loopback():
    """The Ray driver may run elsewhere than the nodes (or on a system without the table): `lo` is known by name."""
    assert loopback_named({"GLOO_SOCKET_IFNAME": "lo"}, {}) == [("GLOO_SOCKET_IFNAME", "lo", "lo")]


def test_the_refusal_names_the_variable_the_interface_why_and_where(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    with pytest.raises(LaunchError) as e:
        refuse_loopback([{"GLOO_SOCKET_IFNAME": "eth0"}, {"GLOO_SOCKET_IFNAME": "lo"}], "num_machines 2", ETH, "eth0")
    assert e.value.exit_code == 2
    assert str(e.value) == (
        "GLOO_SOCKET_IFNAME=lo names lo (127.0.0.1), a loopback interface: on a job across machines (num_machines 2) "
        "the other machines cannot reach it, and the job would hang or fail in its first collective; unset it "
        "(dualrun then gives gloo eth0, the interface the other machines reach this one at) or name that interface "
        "(set in the launching shell)")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    with pytest.raises(LaunchError, match=r"NCCL_SOCKET_IFNAME==lo names lo .*\(set in the config's env\)$"):
        refuse_loopback([{"NCCL_SOCKET_IFNAME": "=lo"}], "num_machines 2", ETH)
    refuse_loopback([{"GLOO_SOCKET_IFNAME": "eth0"}], "num_machines 2", ETH)   # nothing to refuse


@pytest.fixture
def job(tmp_path):
    (tmp_path / "job.yaml").write_text("use_cpu: true\nroles: {train: {gpus: 2}}\n")
    (tmp_path / "s.py").write_text("print('ran')\n")
    return tmp_path


def test_ray_across_nodes_refuses_it_in_its_dry_run(job):
    r = dualrun("launch", "--config_file", "job.yaml", "--backend", "ray", "--num_machines", "2", "--dry_run", "s.py",
                cwd=job, env={"GLOO_SOCKET_IFNAME": "lo"}, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(
        "dualrun: error: GLOO_SOCKET_IFNAME=lo names lo (127.0.0.1), a loopback interface: on a job across machines "
        "(2 Ray nodes of their own addresses) the other machines cannot reach it"), r.stderr


@pytest.mark.parametrize("argv", [
    ["--num_machines", "1"],                                                     # one machine: lo is right
    ["--num_machines", "2", "--machine_rank", "1", "--main_process_ip", "127.0.0.1"],   # machine 0 on loopback too
], ids=["one machine", "machine 0 on this host's loopback"])
def test_torchrun_keeps_lo_where_every_machine_is_this_host(job, argv):
    r = dualrun("launch", "--config_file", "job.yaml", *argv, "--dry_run", "s.py", cwd=job,
                env={"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "GLOO_SOCKET_IFNAME=lo" in r.stdout
