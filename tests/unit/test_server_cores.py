"""A rank leaves the servers starting on its machine cores of their own, and takes them back once they answer
(dualrun/rank/server_cores.py): which cores, which servers are here, the health check, and a real rank-like process
narrowed and widened again."""
from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from dualrun.contract.protocol import SERVERS_STARTING
from dualrun.rank import server_cores as sc


def test_a_rank_keeps_all_but_the_first_core_per_server_here_and_at_least_one():
    assert sc.cores_kept({0, 1}, 1) == {1}
    assert sc.cores_kept({0, 1, 2, 3}, 2) == {2, 3}
    assert sc.cores_kept({4, 5, 6}, 5) == {6}          # never none
    assert sc.cores_kept({0, 1, 2}, 0) == {0, 1, 2}    # no server here
    assert sc.cores_kept({3}, 1) == {3}                # one core: nothing to leave


def test_only_the_servers_on_this_machine_count():
    raw = json.dumps({"servers": {"127.0.0.1:9001": "rollout", "192.0.2.7:9002": "teacher"}, "wait_s": 30,
                      "health": {"127.0.0.1:9001": "/ready"}})
    here, wait_s = sc.servers_here(raw)
    assert here == [("127.0.0.1", 9001, "/ready")] and wait_s == 30   # 192.0.2.7 (TEST-NET) is no address here
    assert sc.servers_here(None) == ([], 0.0)
    old = json.dumps({"servers": {"127.0.0.1:9001": "rollout"}, "wait_s": 5})   # no health paths: /health
    assert sc.servers_here(old)[0] == [("127.0.0.1", 9001, "/health")]


def test_is_local_binds_and_sends_nothing():
    assert sc.is_local("127.0.0.1") and sc.is_local("localhost")
    assert not sc.is_local("192.0.2.7") and not sc.is_local("no-such-host.invalid")


class _Health(http.server.BaseHTTPRequestHandler):
    ok = False

    def do_GET(self):  # noqa: N802
        self.send_response(200 if self.ok and self.path == "/health" else 503)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_the_health_check_is_200_or_not():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        assert not sc.answers("127.0.0.1", port, "/health")   # 503 while it loads
        _Health.ok = True
        assert sc.answers("127.0.0.1", port, "/health") and not sc.answers("127.0.0.1", port, "/other")
    finally:
        server.shutdown()
        _Health.ok = False
    assert not sc.answers("127.0.0.1", port, "/health")   # refused


def test_nothing_is_narrowed_without_omp_num_threads_servers_here_or_cores_to_spare():
    raw = json.dumps({"servers": {"127.0.0.1:1": "rollout"}, "wait_s": 1})
    assert not sc.activate({SERVERS_STARTING: raw})   # a thread pool would size itself from the narrowed set
    assert not sc.activate({"OMP_NUM_THREADS": "1"})
    assert not sc.activate({"OMP_NUM_THREADS": "1", SERVERS_STARTING: json.dumps(
        {"servers": {"192.0.2.7:1": "rollout"}, "wait_s": 1})})


RANK = r"""
import json, os, sys, threading, time
from dualrun.rank import server_cores
before = sorted(os.sched_getaffinity(0))
narrowed = server_cores.activate()
during = sorted(os.sched_getaffinity(0))
late = []
t = threading.Thread(target=lambda: (time.sleep(0.3), late.append(sorted(os.sched_getaffinity(0)))))
t.start(); t.join()
open(sys.argv[1], "w").write("ready")
deadline = time.monotonic() + 60
while time.monotonic() < deadline and sorted(os.sched_getaffinity(0)) != before:
    time.sleep(0.05)
print(json.dumps({"before": before, "narrowed": narrowed, "during": during, "late": late[0],
                  "after": sorted(os.sched_getaffinity(0))}))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a rank narrows its cores only where it has 2 or more")
def test_a_rank_runs_on_fewer_cores_while_its_server_loads_and_on_all_once_it_answers(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"127.0.0.1:{server.server_address[1]}"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               **{SERVERS_STARTING: json.dumps({"servers": {address: "rollout"}, "wait_s": 60,
                                                "health": {address: "/health"}})})
    ready = tmp_path / "ready"
    rank = subprocess.Popen([sys.executable, "-c", RANK, str(ready)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        assert rank.poll() is None   # still narrowed: the server does not answer yet
        _Health.ok = True
        got = json.loads(rank.communicate(timeout=60)[0])
    finally:
        server.shutdown()
        _Health.ok = False
        if rank.poll() is None:
            rank.kill()
    assert got["narrowed"] and got["during"] == got["before"][1:]   # the first core left to the server
    assert got["late"] == got["during"]                              # a thread started meanwhile: narrowed too
    assert got["after"] == got["before"]                             # every thread back on all of them
