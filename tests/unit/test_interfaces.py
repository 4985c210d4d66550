"""What `dualrun check` on several torchrun machines reads from each machine and compares (pure parts; the
meeting itself runs on the virtual cluster, tests/cluster/test_cluster_check.py): which interface variables a machine
cannot honour, the address gloo would advertise there, and what each machine advertises to the others."""
from __future__ import annotations

import pytest

from helpers import dualrun
from dualrun.config import build_config
from dualrun.light.interfaces import Interface, gloo_address, ifname_problems, listing, owner
from dualrun.plan.processes import make_plan

ETH = {"lo": Interface("lo", "127.0.0.1", "unknown"), "eth0": Interface("eth0", "192.168.77.2", "up"),
       "ib0": Interface("ib0", None, "down")}


@pytest.mark.parametrize("env, expected", [
    ({}, []),
    ({"GLOO_SOCKET_IFNAME": "eth0"}, []),
    ({"GLOO_SOCKET_IFNAME": "eth0,ens5"}, ["GLOO_SOCKET_IFNAME=eth0,ens5 names ens5, which this machine does not have"]),
    ({"GLOO_SOCKET_IFNAME": "ib0"}, ["GLOO_SOCKET_IFNAME=ib0 names ib0, which has no IPv4 address here"]),
    ({"NCCL_SOCKET_IFNAME": "eth"}, []),                        # NCCL: a prefix
    ({"NCCL_SOCKET_IFNAME": "=eth"}, ["NCCL_SOCKET_IFNAME==eth matches no interface of this machine with an "
                                      "address"]),             # `=`: exact names only
    ({"NCCL_SOCKET_IFNAME": "ib"}, ["NCCL_SOCKET_IFNAME=ib matches no interface of this machine with an address"]),
    ({"NCCL_SOCKET_IFNAME": "^docker,lo"}, []),                 # an exclusion list: nothing to break here
    ({"TP_SOCKET_IFNAME": "ens5"}, ["TP_SOCKET_IFNAME=ens5 names ens5, which this machine does not have"]),
])
def test_interface_variables_a_machine_cannot_honour(env, expected):
    assert ifname_problems(env, ETH) == expected


def test_gloo_advertises_its_interface_else_what_the_host_name_resolves_to_else_loopback():
    assert gloo_address({"GLOO_SOCKET_IFNAME": "eth0,lo"}, ETH) == ("192.168.77.2", "GLOO_SOCKET_IFNAME=eth0")
    assert gloo_address({"GLOO_SOCKET_IFNAME": "ens5"}, ETH) == (None, "GLOO_SOCKET_IFNAME=ens5")
    assert gloo_address({}, ETH, hostname="localhost") == (
        "127.0.0.1", "the host name localhost resolves to it; GLOO_SOCKET_IFNAME is unset")
    # a name that resolves to no address of this machine (here: none at all): torch falls back to loopback
    assert gloo_address({}, ETH, hostname="no-such-host.invalid") == (
        "127.0.0.1", "the host name no-such-host.invalid resolves to no address of this machine, so gloo falls back "
                     "to loopback; GLOO_SOCKET_IFNAME is unset")


def test_interfaces_are_listed_addresses_first_and_found_by_address():
    assert listing(ETH) == "eth0 192.168.77.2, lo 127.0.0.1, ib0 without an IPv4 address (down)"
    assert owner("192.168.77.2", ETH).name == "eth0" and owner("127.0.1.1", ETH).name == "lo"
    assert owner("192.168.77.9", ETH) is None


def _cfg(rank: int, **more):
    spec = {"use_cpu": True, "method": "gkd", "num_machines": 2, "machine_rank": rank, "main_process_ip": "127.0.0.1",
            "torchrun": {"gpus_per_machine": 2}, "env": {"GLOO_SOCKET_IFNAME": "lo"},
            "roles": {"train": {"gpus": 2}, "teacher": {"gpus": 2, "model": "m/m", "top_k": 5,
                                                         "env": {"GLOO_SOCKET_IFNAME": "ens5"}}}}
    spec.update(more)
    return build_config(spec, "job.yaml")


def test_each_machine_advertises_gloos_address_per_process_env_and_its_servers_route_address():
    from dualrun.backends.torchrun.machine_check import advertised, process_envs

    cfg = _cfg(1)
    plan = make_plan(cfg)
    assert process_envs(cfg, plan, 1) == [{"GLOO_SOCKET_IFNAME": "lo"}, {"GLOO_SOCKET_IFNAME": "ens5"}]
    # where no variable names an interface, the check sees what `dualrun launch` gives gloo: the route's (lo here)
    bare = _cfg(1, method="sft", env={}, roles={"train": {"gpus": 2}})
    assert process_envs(bare, make_plan(bare), 1) == [{"GLOO_SOCKET_IFNAME": "lo"}]
    ifaces = {"lo": Interface("lo", "127.0.0.1", "unknown")}
    items = advertised(cfg, plan, 1, ifaces, None)
    assert [(i["what"], i["address"], i["interface"]) for i in items] == [
        ("gloo's address", "127.0.0.1", "lo"),                 # ens5 is missing: a problem of its own, no address
        ("its servers' address", "127.0.0.1", "lo")]           # its route to main_process_ip


def test_wait_s_of_the_check_is_a_number_of_seconds(tmp_path):
    (tmp_path / "job.yaml").write_text("use_cpu: true\nroles: {train: {gpus: 2}}\n")
    for bad in ("0", "nan", "-3", "x"):
        proc = dualrun("check", "--config_file", "job.yaml", "--wait_s", bad, cwd=tmp_path)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "--wait_s" in proc.stderr


def test_gloo_is_given_the_interface_holding_the_address_the_others_reach_unless_the_user_names_one():
    from dualrun.light.interfaces import gloo_ifname

    assert gloo_ifname({}, "192.168.77.2", ETH).name == "eth0"
    assert gloo_ifname({}, "127.0.0.1", ETH).name == "lo"
    assert gloo_ifname({}, "192.168.77.9", ETH) is None and gloo_ifname({}, None, ETH) is None
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME"):
        assert gloo_ifname({var: "ib0"}, "192.168.77.2", ETH) is None   # the user's value wins
    assert gloo_ifname({"GLOO_SOCKET_IFNAME": " "}, "192.168.77.2", ETH).name == "eth0"   # blank: unset


def _torchrun(tmp_path, monkeypatch, machines: int, env: dict | None = None, shell: dict | None = None):
    """A torchrun launch's prepared env and dry run, with only `shell`'s interface variables in the launching env."""
    from dualrun.backends import backend_of
    from dualrun.launchers import Program
    from dualrun.methods.plugin import get_plugin

    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME"):
        monkeypatch.delenv(var, raising=False)
    for var, value in (shell or {}).items():
        monkeypatch.setenv(var, value)
    cfg = build_config({"use_cpu": True, "num_processes": 2, "num_machines": machines, "main_process_ip": "127.0.0.1",
                        "env": env or {}}, str(tmp_path / "c.yaml"))
    launcher = backend_of(cfg).launcher(cfg, Program(str(tmp_path / "job.py")), get_plugin(cfg.method), {})
    prepared = launcher.prepare(make_plan(cfg))
    return prepared.env, launcher.describe(prepared).splitlines()


def test_several_torchrun_machines_give_gloo_the_interface_of_the_route_to_machine_0(tmp_path, monkeypatch):
    """The ranks and the servers (the weight sync's members) get it, the dry run says so; the route to 127.0.0.1 is
    lo's."""
    from dualrun.backends import backend_of
    from dualrun.launchers import Program
    from dualrun.methods.plugin import get_plugin

    cfg = build_config({"use_cpu": True, "method": "gkd", "num_machines": 2, "main_process_ip": "127.0.0.1",
                        "roles": {"train": {"gpus": 2}, "teacher": {"gpus": 1, "model": "m/m", "top_k": 5}}}, "c.yaml")
    launcher = backend_of(cfg).launcher(cfg, Program("job.py"), get_plugin(cfg.method), {})
    env, text = _torchrun(tmp_path, monkeypatch, 2)   # (the launching env's interface variables removed)
    plan = make_plan(cfg)
    servers = launcher.server_set(plan, 0, frozenset())
    servers = getattr(servers, "servers", servers)   # several machines: this machine's LocalServers inside
    assert servers.env_for(plan.servers[0])["GLOO_SOCKET_IFNAME"] == "lo"
    assert env["GLOO_SOCKET_IFNAME"] == "lo" and "  GLOO_SOCKET_IFNAME=lo \\" in text
    assert text[1] == ("# GLOO_SOCKET_IFNAME=lo for this machine's processes: lo holds 127.0.0.1, the address the other "
                       "machines reach it at (its route to main_process_ip 127.0.0.1; unset, gloo takes what the host "
                       "name resolves to); set GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME to choose yourself")


@pytest.mark.parametrize("machines, env, shell, expected", [
    (1, {}, {}, None),                                            # one machine: gloo's own choice
    (2, {"GLOO_SOCKET_IFNAME": "eth7"}, {}, "eth7"),              # the config's value wins
    (2, {"NCCL_SOCKET_IFNAME": "eth7"}, {}, None),                # so does any interface variable
    (2, {}, {"GLOO_SOCKET_IFNAME": "eth9"}, "eth9"),              # and the launching shell's
])
def test_a_users_interface_variable_always_wins(tmp_path, monkeypatch, machines, env, shell, expected):
    env_, text = _torchrun(tmp_path, monkeypatch, machines, env, shell)
    assert env_.get("GLOO_SOCKET_IFNAME") == expected and not any("for this machine's processes" in t for t in text)


@pytest.mark.parametrize("shell, said", [({}, True), ({"NCCL_SOCKET_IFNAME": "ib"}, False)])
def test_the_ray_dry_run_says_each_node_gives_gloo_its_interface_unless_the_user_names_one(tmp_path, monkeypatch,
                                                                                            shell, said):
    """On Ray the interface is each node's own (the one holding its Ray address): the dry run names the rule."""
    from dualrun.backends import backend_of
    from dualrun.launchers import Program
    from dualrun.methods.plugin import get_plugin

    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME"):
        monkeypatch.delenv(var, raising=False)
    for var, value in shell.items():
        monkeypatch.setenv(var, value)
    cfg = build_config({"backend": "ray", "use_cpu": True, "num_processes": 2}, str(tmp_path / "c.yaml"))
    launcher = backend_of(cfg).launcher(cfg, Program(str(tmp_path / "job.py")), get_plugin(cfg.method), {})
    text = launcher.describe(launcher.prepare(make_plan(cfg)))
    rule = ("on nodes of several addresses GLOO_SOCKET_IFNAME=<auto> for each rank and server whose env names no "
            "interface: its node's interface holding the node's Ray address")
    assert (rule in text.splitlines()[1]) is said


@pytest.mark.parametrize("shell, said", [({}, True), ({"VLLM_HOST_IP": "10.1.2.3"}, False)])
def test_the_ray_dry_run_says_each_rank_advertises_its_node_address_unless_the_user_sets_one(tmp_path, monkeypatch,
                                                                                              shell, said):
    """On nodes of several addresses each rank's VLLM_HOST_IP (the weight-sync master's address that vLLM's get_ip()
    returns) is its node's Ray address: the dry run names the rule, unless the user's env sets one."""
    from dualrun.backends import backend_of
    from dualrun.launchers import Program
    from dualrun.methods.plugin import get_plugin

    monkeypatch.delenv("VLLM_HOST_IP", raising=False)
    for var, value in shell.items():
        monkeypatch.setenv(var, value)
    cfg = build_config({"backend": "ray", "use_cpu": True, "num_processes": 2}, str(tmp_path / "c.yaml"))
    launcher = backend_of(cfg).launcher(cfg, Program(str(tmp_path / "job.py")), get_plugin(cfg.method), {})
    text = launcher.describe(launcher.prepare(make_plan(cfg)))
    rule = "on nodes of several addresses VLLM_HOST_IP=<auto> for each rank whose env sets none: its node's Ray address"
    assert (rule in text.splitlines()[1]) is said


def test_a_machine_is_reached_at_its_route_to_machine_0_unless_that_is_loopback_for_a_name():
    """Machine 0 whose own name (main_process_ip) resolves to 127.0.1.1 there (Debian's hosts line) is reached at its
    address on the route out; a loopback address given as such stays (every machine on one host)."""
    from unittest import mock

    from dualrun.light import interfaces

    routes = {"head": ("127.0.1.1", None), "8.8.8.8": ("10.0.0.1", None), "127.0.0.1": ("127.0.0.1", None),
              "10.0.0.1": ("10.0.0.1", None)}
    with mock.patch.object(interfaces, "route", lambda peer: routes[peer]):
        assert interfaces.reached_at("head") == "10.0.0.1"
        assert interfaces.reached_at("127.0.0.1") == "127.0.0.1"
        assert interfaces.reached_at("10.0.0.1") == "10.0.0.1"
