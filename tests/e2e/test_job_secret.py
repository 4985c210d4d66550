"""Who may reach a job's servers: the per-job secret that the router's control endpoints require, and a one-machine
job's rendezvous store on loopback alone. Pure rules, then real processes on loopback (a router in front of
recording replicas; torch's TCPStore)."""
from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request

import pytest

from dualrun.contract import job_token, protocol
from helpers import ASSETS, free_port

pytestmark = pytest.mark.timeout(120)

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


# -- pure rules ------------------------------------------------------------------------------------------------
def test_refusal_without_or_with_a_wrong_token():
    token = job_token.new_token()
    assert len(token) >= 40 and token != job_token.new_token()
    assert job_token.refusal(None, token) == 401
    assert job_token.refusal("", token) == 401
    assert job_token.refusal("wrong", token) == 403
    assert job_token.refusal(f"{token}x", token) == 403
    assert job_token.refusal(token, token) is None and job_token.refusal(f" {token} ", token) is None
    assert job_token.refusal(None, None) is None and job_token.refusal("x", "") is None   # no token, no guard
    assert job_token.auth_headers(token) == {"X-Dualrun-Job-Token": token}
    # a user's --api-key: `Authorization: Bearer KEY`, as vLLM reads it
    assert job_token.api_key_refusal(None, "k3y") == 401 and job_token.api_key_refusal("Basic k3y", "k3y") == 401
    assert job_token.api_key_refusal("Bearer nope", "k3y") == 403
    assert job_token.api_key_refusal("Bearer k3y", "k3y") is None and job_token.api_key_refusal(None, None) is None
    assert job_token.auth_headers(None) == {}


def _cfg(text: str, tmp_path):
    from dualrun.config.load import load_config

    path = tmp_path / "job.yaml"
    path.write_text(text)
    return load_config(str(path))


def test_each_launch_has_its_own_secret_in_every_process_env_and_never_shown(tmp_path, monkeypatch):
    from dualrun.contract.redact import redact
    from dualrun.launchers.launcher import job_token_for
    from dualrun.plan.meeting import rendezvous_of

    monkeypatch.delenv(protocol.JOB_TOKEN, raising=False)
    one = _cfg("use_cpu: true\nroles: {train: {gpus: 2}}\n", tmp_path)
    assert job_token_for(rendezvous_of(one)) != job_token_for(rendezvous_of(one)) and len(job_token_for(rendezvous_of(one))) >= 40
    assert redact({protocol.JOB_TOKEN: "abcdef"})[protocol.JOB_TOKEN] != "abcdef"
    # torchrun on several machines (each its own launcher): machine 0 makes one, the others read it from its store
    # at launch (tests/cluster/test_cluster_job_secret.py); a token the user gives is every machine's own
    two = _cfg("use_cpu: true\nnum_machines: 2\nmain_process_ip: 10.0.0.1\nmain_process_port: 29500\n"
               "roles: {train: {gpus: 2}}\n", tmp_path)
    other = _cfg("use_cpu: true\nnum_machines: 2\nmachine_rank: 1\nmain_process_ip: 10.0.0.1\n"
                 "main_process_port: 29500\nroles: {train: {gpus: 2}}\n", tmp_path)
    assert len(job_token_for(rendezvous_of(two))) >= 40 and job_token_for(rendezvous_of(other)) == ""
    monkeypatch.setenv(protocol.JOB_TOKEN, "given-on-every-machine")
    assert job_token_for(rendezvous_of(two)) == job_token_for(rendezvous_of(one)) == job_token_for(rendezvous_of(other)) == "given-on-every-machine"


@pytest.mark.e2e
def test_machine_k_takes_machine_0s_secret_from_its_store_or_names_why_not():
    """What machine K's launch reads before its servers start (servers.machines.take_token), through a real TCPStore
    standing in for torchrun's agent store: the secret machine 0 put there; one line and exit 2 when machine 0's is
    the user's (set there alone: not handed out); one line naming machine 0 when its store never answers."""
    from torch.distributed import TCPStore

    from dualrun.contract import job_store
    from dualrun.contract.errors import LaunchError
    from dualrun.backends.torchrun.machine_servers import take_token

    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    store.set(job_store.TOKEN_KEY, "made-by-machine-0-" * 3)
    assert take_token("127.0.0.1", port, 1, 10.0) == "made-by-machine-0-" * 3
    store.set(job_store.TOKEN_KEY, "")
    with pytest.raises(LaunchError) as given:
        take_token("127.0.0.1", port, 2, 10.0)
    assert given.value.exit_code == 2 and str(given.value) == (
        "DUALRUN_JOB_TOKEN: expected the same value on every machine, got unset on machine 2 while machine 0 has "
        "one (set it on every machine, or on none)")
    closed = free_port()
    with pytest.raises(LaunchError) as absent:
        take_token("127.0.0.1", closed, 1, 2.0)
    assert absent.value.exit_code == 1 and str(absent.value).startswith(
        f"machine 0 (127.0.0.1) did not hand over the job's secret within 2 s (torchrun.rendezvous_timeout_s; its "
        f"store at 127.0.0.1:{closed}, main_process_ip and main_process_port): it is not started, has ended, or this "
        "machine cannot reach it ("), str(absent.value)


def test_dry_run_masks_the_secret(tmp_path):
    from helpers import dualrun

    (tmp_path / "job.yaml").write_text("use_cpu: true\nroles: {train: {gpus: 2}}\n")
    (tmp_path / "w.py").write_text("print('hi')\n")
    proc = dualrun("launch", "--dry_run", "--config_file", "job.yaml", "w.py", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    shown = proc.stdout + proc.stderr
    line = [l for l in shown.splitlines() if protocol.JOB_TOKEN in l]
    assert line and all("***" in l for l in line), line


# -- the router's control endpoints -----------------------------------------------------------------------------
def _post(url: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with _OPENER.open(request, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@pytest.fixture
def guarded_router(tmp_path):
    """A router holding the job's secret in front of two recording replicas (and a third engine a hostile client
    would point it at)."""
    from dualrun.plan.server_commands import router_argv
    from test_router import _server, _start_all

    token = job_token.new_token()
    rec = tmp_path / "rec"
    rec.mkdir()
    replicas = [_server(f"r{i}", [sys.executable, str(ASSETS / "recording_replica.py"), str(free_port()), "1",
                                  str(rec), f"r{i}"], tmp_path / f"r{i}.log", env={"REPLICAS": "2"})
                for i in range(3)]
    _start_all(replicas)
    router = _server("router", router_argv("127.0.0.1", free_port(), [r.address for r in replicas[:2]]),
                     tmp_path / "router.log", env={protocol.JOB_TOKEN: token})
    try:
        _start_all([router])
        yield router, replicas, token
    finally:
        for s in [router, *replicas]:
            s.stop(grace_s=2)


@pytest.mark.e2e
def test_router_control_needs_the_job_secret(guarded_router, monkeypatch):
    from dualrun.servers import router_client

    router, replicas, token = guarded_router
    base = f"http://{router.address}{'/router/replicas'}"
    intruder = replicas[2].address
    for action, body in (("replace", {"address": intruder}), ("remove", {"reason": "x"}), ("restore", {})):
        assert _post(f"{base}/0/{action}", body)[0] == 401
        assert _post(f"{base}/1/{action}", body, {"X-Dualrun-Job-Token": "guessed"})[0] == 403
        assert _post(f"{base}/1/{action}", body, {"Authorization": f"Bearer {token}"})[0] == 401   # not its header
    table = router_client.replicas(router.address)
    assert [r["address"] for r in table["replicas"]] == [r.address for r in replicas[:2]]
    assert table["in_rotation"] == [0, 1] and table["membership"] == 0
    # the launcher's own client carries it (from its env, as the launch sets it)
    monkeypatch.setenv(protocol.JOB_TOKEN, token)
    row = router_client.control(router.address, 1, "remove", reason="the launcher's own")["replica"]
    assert row["in_rotation"] is False
    monkeypatch.delenv(protocol.JOB_TOKEN)
    with pytest.raises(RuntimeError, match="only the job.s own processes may ask it"):
        router_client.control(router.address, 1, "restore")


# -- the rendezvous store --------------------------------------------------------------------------------------
def listeners() -> list[str]:
    """`address:port` (hex, as the kernel writes it) of every TCP socket listening in this network namespace."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if os.path.exists(table):
            for line in open(table).read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":   # LISTEN
                    found.append(fields[1])
    return found


def on_every_interface(addresses: list[str]) -> list[str]:
    """Those of `addresses` bound to every interface (0.0.0.0 or ::)."""
    return [a for a in addresses if set(a.split(":")[0]) == {"0"}]


@pytest.mark.e2e
def test_loopback_store_listens_on_loopback_alone():
    import torch.distributed as dist

    from dualrun.light.loopback_store import loopback_stores

    before = set(listeners())
    plain = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    own = sorted(a for a in set(listeners()) - before if int(a.rpartition(":")[2], 16) == plain.port)
    assert on_every_interface(own)   # torch's own: every interface
    del plain
    real = dist.TCPStore
    before = set(listeners())
    with loopback_stores():
        store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    assert dist.TCPStore is real and isinstance(store, real)   # torch's own again once out
    # the store's own port only: other tests of the run open listeners meanwhile (a Ray cluster's, say)
    new = sorted(a for a in set(listeners()) - before if int(a.rpartition(":")[2], 16) == store.port)
    assert new and not on_every_interface(new) and all(a.startswith("0100007F:") for a in new), new
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
    client.set("k", "v")
    assert store.get("k") == b"v"


# -- what the trainers' clients carry -----------------------------------------------------------------------------
def test_trainers_requests_to_the_jobs_servers_carry_its_headers_and_no_others():
    from dualrun.rank.server_auth import headers_for

    env = {protocol.JOB_TOKEN: "s3cret", protocol.address_env("teacher"): "127.0.0.1:8001",
           protocol.address_env("rollout"): "127.0.0.1:8002", protocol.api_key_env("rollout"): "k3y"}
    assert headers_for("http://127.0.0.1:8001/v1/completions", env) == {"X-Dualrun-Job-Token": "s3cret"}
    assert headers_for("http://127.0.0.1:8002/update_weights", env) == {"X-Dualrun-Job-Token": "s3cret",
                                                                        "Authorization": "Bearer k3y"}
    assert headers_for("http://127.0.0.1:9999/v1/completions", env) == {}     # not the job's: nothing leaves
    assert headers_for("http://example.com/x", env) == {}
    assert headers_for("http://127.0.0.1:8001/v1/completions", env, step=12) == {"X-Dualrun-Job-Token": "s3cret",
                                                                              "X-Dualrun-Step": "12"}
    assert headers_for("http://example.com/x", env, step=12) == {}   # the step goes to the job's servers alone


def test_a_roles_api_key_reaches_the_router_and_the_trainers(tmp_path):
    from dualrun.methods.plugin import MethodPlugin
    from dualrun.contract.redact import api_key_of
    from dualrun.plan.server_commands import server_command
    from dualrun.plan.processes import ROUTER

    assert api_key_of(["--verbose", "--api-key", "k1"]) == "k1" and api_key_of(["--api_key=k2"]) == "k2"
    assert api_key_of(["--api-k", "k3"]) == "k3" and api_key_of(["--top-k", "5"]) is None
    cfg = _cfg("use_cpu: true\nmethod: gkd\nroles:\n  train: {gpus: 1}\n  teacher: {gpus: 2, model: m, "
               "server_args: [--api-key, k3y]}\n", tmp_path)
    assert MethodPlugin().wiring_env(cfg, {"teacher": "127.0.0.1:8000"}) == {
        protocol.address_env("teacher"): "127.0.0.1:8000", protocol.api_key_env("teacher"): "k3y"}
    router = type("P", (), {"kind": ROUTER, "roles": ("teacher",), "world_size": 2, "unit": "teacher"})()
    argv = server_command(cfg, None, router, "127.0.0.1", 8000, ["127.0.0.1:1", "127.0.0.1:2"])
    assert argv[argv.index("--api-key") + 1] == "k3y"


def test_which_endpoints_need_the_secret():
    from dualrun.programs import guard, vllm_guard

    for path in ("/router/replicas/0/replace", "/update_weights", "/init_weight_transfer_engine", "/pause?mode=keep",
                 "/resume", "/reset_prefix_cache", "/v1/load_lora_adapter"):
        assert guard.job_only("POST", path), path
    for method, path in (("GET", "/health"), ("GET", "/router/stats"), ("POST", "/v1/completions"),
                         ("GET", "/server_info"), ("GET", "/get_world_size")):
        assert not guard.job_only(method, path), path
    # a vLLM server: every path but inference (the --api-key's) and the health checks
    for path in ("/pause", "/sleep", "/wake_up", "/collective_rpc", "/init_weight_transfer_engine",
                 "/update_weights", "/server_info", "/reset_prefix_cache"):
        assert vllm_guard.job_only("POST", path), path
    for path in ("/health", "/ping", "/version", "/metrics", "/v1/completions", "/v1/models", "/inference/v1/generate"):
        assert not vllm_guard.job_only("GET", path), path
    assert guard.refusal("POST", "/pause", {}, "t", None) == (401, guard.refusal("POST", "/pause", {}, "t", None)[1])
    assert guard.refusal("POST", "/pause", {"X-Dualrun-Job-Token": "t"}, "t", None) is None
    assert guard.refusal("POST", "/v1/completions", {}, "t", "k")[0] == 401
    assert guard.refusal("POST", "/v1/completions", {"Authorization": "Bearer k"}, "t", "k") is None


def test_ray_servers_listen_on_loopback_only_when_every_node_is_this_machine():
    from types import SimpleNamespace

    from dualrun.backends.ray.actor_servers import grows_elsewhere, on_this_host

    def plan(*addresses, spare=False):
        servers = [SimpleNamespace(serving=SimpleNamespace(spare=spare))]
        return SimpleNamespace(cluster=SimpleNamespace(nodes=[SimpleNamespace(address=a) for a in addresses]),
                               servers=servers)

    assert on_this_host(plan("127.0.0.1")) and on_this_host(plan("127.0.0.1", "127.0.0.1"))   # nodes on one host
    assert not on_this_host(plan("127.0.0.1", "10.0.0.2"))        # several machines: their own addresses
    assert not on_this_host(plan("203.0.113.9"))                 # one node elsewhere (joined through ray://)
    # a fleet's spare may start on a node that joins later, unless the cluster is bound to loopback (embedded)
    assert on_this_host(plan("127.0.0.1", spare=True)) and not grows_elsewhere(plan("127.0.0.1", spare=True))
    assert grows_elsewhere(plan("10.0.0.2", spare=True)) and not grows_elsewhere(plan("10.0.0.2"))


def test_the_middleware_vllm_is_given_is_the_guard_and_a_coroutine_function():
    """vLLM adds a `--middleware` import path that names a coroutine function as `@app.middleware("http")`."""
    import importlib
    import inspect

    from dualrun.methods.commands import VLLM_MIDDLEWARE
    from dualrun.programs import vllm_guard

    module, _, name = VLLM_MIDDLEWARE.rpartition(".")
    target = getattr(importlib.import_module(module), name)
    assert target is vllm_guard.job_guard and inspect.iscoroutinefunction(target)
