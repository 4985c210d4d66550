"""Where trainer rank 0's weight-sync store listens. Every process of a one-host job reaches loopback, so the
trainers get VLLM_HOST_IP=127.0.0.1 (vLLM's `get_ip()`, the `master_address` TRL's client gives the engines) and the
store at a loopback address listens there alone, not on every interface as torch's store does whatever its host; a
job with a process on another host, or a user's own address, keeps the route address."""
from __future__ import annotations

import socket
from datetime import timedelta

from dualrun.weightsync.sync_group import group_host_env
from dualrun.weightsync.rehearsal import master_endpoint
from dualrun.weightsync.wire import tcp_store

WIRED = True   # Plan.weight_sync: the trainers push their weights to a separate role's engines


def test_one_host_jobs_with_a_rollout_advertise_loopback():
    assert group_host_env(WIRED, {}, one_host=True) == {"VLLM_HOST_IP": "127.0.0.1"}


def test_no_loopback_across_hosts_without_a_rollout_or_over_the_users_address():
    assert group_host_env(WIRED, {}, one_host=False) == {}             # a replica elsewhere must reach rank 0
    assert group_host_env(False, {}, one_host=True) == {}              # no weight sync
    assert group_host_env(WIRED, {"VLLM_HOST_IP": "10.0.0.5"}, one_host=True) == {}
    ignored = group_host_env(WIRED, {"HOST_IP": "10.0.0.5"}, one_host=True)   # vLLM ignores HOST_IP
    assert ignored == {"VLLM_HOST_IP": "127.0.0.1"}


def test_the_checks_rehearsal_advertises_as_the_job_does():
    assert master_endpoint("127.0.0.1", {})[0] == "127.0.0.1"
    assert master_endpoint("127.0.0.1", {"VLLM_HOST_IP": "10.0.0.5"})[0] == "10.0.0.5"


def _listening(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp writes them) of the TCP sockets listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    found.add(local.rsplit(":", 1)[0])
    return found


def test_a_store_at_loopback_listens_on_loopback_alone_and_members_join():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    master = tcp_store("127.0.0.1", port, 0, 2, timedelta(seconds=30))
    member = tcp_store("127.0.0.1", port, 1, 2, timedelta(seconds=30))
    member.set("k", "v")
    assert master.get("k") == b"v"
    assert _listening(port) == {"0100007F"}   # 127.0.0.1, no 0.0.0.0 / :: listener
