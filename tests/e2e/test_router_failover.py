"""The router when a replica fails, with real processes on loopback: stub replicas
(tests/support/assets/recording_replica.py, which records each request on arrival and answers each prompt with itself)
behind a real router. A replica SIGKILLed with a request on it: that request and every other one is answered once,
correctly, by the replica left; one SIGSTOPped: found by request_timeout_s (probes off), or by the health probes, the
request retried elsewhere; a 5xx takes a replica out, but a request that fails on every replica gets the engine's
answer, as with one engine; the launcher's control endpoints swap in a new engine held out of rotation until restored;
the weight-transfer calls follow the members (a removed replica left out, its replacement in, held until its first
completed update); the last replica dead: the request fails naming it, as with one engine. (The rules themselves:
test_rotation.py.)"""
from __future__ import annotations

import os
import re
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dualrun.servers import router_client
from helpers import eventually, free_port
from helpers import ASSETS
from test_router import _recorded, _server, _start_all

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def _stubs(tmp_path: Path, count: int, first: int = 0) -> list:
    rec = tmp_path / "rec"
    rec.mkdir(exist_ok=True)
    return _start_all([_server(f"r{i}", [sys.executable, str(ASSETS / "recording_replica.py"), str(free_port()), "1",
                                         str(rec), f"r{i}"], tmp_path / f"r{i}.log")
                       for i in range(first, first + count)])


def _router(tmp_path: Path, replicas, *flags: str):
    from dualrun.plan.server_commands import router_argv

    argv = router_argv("127.0.0.1", free_port(), [r.address for r in replicas]) + list(flags)
    return _start_all([_server("router", argv, tmp_path / "router.log")])[0]


def _post(base: str, path: str, payload: dict, timeout: float = 60):
    import requests

    return requests.post(f"{base}{path}", json=payload, timeout=timeout, proxies={"http": None})


def _complete(base: str, prompt, **extra) -> dict:
    r = _post(base, "/v1/completions", {"model": "m", "prompt": prompt, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def _stats(base: str) -> dict:
    return router_client.replicas(base.removeprefix("http://"))


def _prompts_of(tmp_path: Path, name: str) -> list:
    path = tmp_path / "rec" / f"{name}.jsonl"
    posts = [r for r in _recorded(tmp_path / "rec", name) if r["path"] == "/v1/completions"] if path.exists() else []
    return [p for r in posts for p in (r["body"]["prompt"] if isinstance(r["body"]["prompt"], list)
                                       else [r["body"]["prompt"]])]


def _stop(*servers) -> None:
    for s in servers:
        if s.alive():
            os.kill(s.proc.pid, signal.SIGCONT)
        s.stop(grace_s=2)


def test_a_killed_replica_loses_no_request_and_answers_none_twice_then_the_last_one_is_an_error(tmp_path):
    import requests

    replicas = _stubs(tmp_path, 2)
    router = _router(tmp_path, replicas, "--request-timeout-s", "30")
    base = f"http://{router.address}"
    try:
        # a slow request, and load around it: single prompts and split many-prompt requests, 4 at a time
        with ThreadPoolExecutor(5) as pool:
            slow = pool.submit(_complete, base, "slow-one", delay_s=30, slow_on="r0")   # the first pick: replica 0
            assert eventually(lambda: "slow-one" in _prompts_of(tmp_path, "r0"), timeout=10, every=0.05)
            victim = 0
            load = [pool.submit(_complete, base, f"p{k}" if k % 3 else [f"p{k}a", f"p{k}b", f"p{k}c"], delay_s=0.05)
                    for k in range(40)]
            time.sleep(0.3)
            os.kill(replicas[victim].proc.pid, signal.SIGKILL)   # with the slow request (and maybe more) on it
            killed = time.monotonic()
            answer = slow.result(timeout=60)
            answers = [f.result(timeout=60) for f in load]
        left = 1 - victim
        assert answer["replica"] == f"r{left}" and [c["text"] for c in answer["choices"]] == ["slow-one"]
        assert time.monotonic() - killed < 10   # retried at the kill, not after request_timeout_s (30 s)
        for k, a in enumerate(answers):         # each its own answer, in order: nothing lost, mixed or doubled
            want = [f"p{k}"] if k % 3 else [f"p{k}a", f"p{k}b", f"p{k}c"]
            assert [(c["index"], c["text"]) for c in a["choices"]] == list(enumerate(want))
        assert _prompts_of(tmp_path, f"r{left}").count("slow-one") == 1   # asked again once, on the replica left
        stats = _stats(base)
        assert stats["in_rotation"] == [left] and not stats["replicas"][victim]["in_rotation"]
        log = Path(router.log_path).read_text()
        assert f"dualrun router: replica {victim} ({replicas[victim].address}) out of rotation: " in log
        assert log.count("out of rotation") == 1 and "1 of 2 in rotation" in log
        health = requests.get(f"{base}/health", timeout=10, proxies={"http": None})
        assert health.status_code == 200 and health.json()["in_rotation"] == 1   # serving: healthy

        # the last replica dies: the request fails, naming it, as with one engine; health goes red
        os.kill(replicas[left].proc.pid, signal.SIGKILL)
        r = _post(base, "/v1/completions", {"model": "m", "prompt": "too late"})
        assert r.status_code in (502, 503), r.text
        message = r.json()["error"]["message"]
        assert f"replica {left} ({replicas[left].address})" in message and f"replica {victim}" in message
        assert eventually(lambda: requests.get(f"{base}/health", timeout=10, proxies={"http": None}).status_code
                          == 503, timeout=10)
    finally:
        _stop(router, *replicas)


@pytest.mark.slow
def test_a_stopped_replica_is_found_by_request_timeout_s_and_the_request_retried(tmp_path):
    replicas = _stubs(tmp_path, 2)
    router = _router(tmp_path, replicas, "--request-timeout-s", "3", "--probe-interval-s", "0")  # no probes
    base = f"http://{router.address}"
    try:
        os.kill(replicas[0].proc.pid, signal.SIGSTOP)   # a hung engine: the kernel accepts, nobody answers
        took = []
        for k in range(4):                              # round-robin: one of the first two lands on the hung one
            start = time.monotonic()
            assert [c["text"] for c in _complete(base, f"q{k}")["choices"]] == [f"q{k}"]
            took.append(time.monotonic() - start)
        assert sum(t >= 3 for t in took) == 1 and took[2] < 3 and took[3] < 3, took   # then it is out
        assert _prompts_of(tmp_path, "r1") == ["q0", "q1", "q2", "q3"]
        stats = _stats(base)["replicas"]
        assert stats[0]["kind"] == "timeout" and not stats[0]["in_rotation"]
        assert "gave no answer within 3 s (request_timeout_s)" in stats[0]["reason"]
        assert "replica 0 (" in Path(router.log_path).read_text()
    finally:
        _stop(router, *replicas)


def test_a_5xx_takes_a_replica_out_but_a_request_that_fails_everywhere_is_answered_as_one_engine_would(tmp_path):
    replicas = _stubs(tmp_path, 2)
    router = _router(tmp_path, replicas, "--probe-interval-s", "0")   # no probes: what the 5xx did stays
    base = f"http://{router.address}"
    try:
        r = _post(base, "/v1/completions", {"model": "m", "prompt": "bad", "fail_on": "all"})  # on r0, then r1
        assert r.status_code == 500 and r.json()["error"]["message"] == "r1 failed on purpose"  # r1's own answer
        stats = _stats(base)
        assert stats["in_rotation"] == [1]      # the first 5xx took r0 out; the second was the request's fault
        assert stats["replicas"][0]["kind"] == "status" and "answered 500" in stats["replicas"][0]["reason"]
        r = _post(base, "/v1/completions", {"model": "m", "prompt": "bad", "fail_on": "r1"})
        assert r.status_code == 500 and _stats(base)["in_rotation"] == [1]   # the last one in rotation stays
        assert _complete(base, "fine")["replica"] == "r1"
    finally:
        _stop(router, *replicas)


@pytest.mark.slow
def test_probes_take_a_stopped_replica_out_and_back_and_a_new_engine_is_held_until_restored(tmp_path):
    import requests

    replicas = _stubs(tmp_path, 2)
    router = _router(tmp_path, replicas, "--request-timeout-s", "60")
    base = f"http://{router.address}"
    spare = None
    try:
        os.kill(replicas[1].proc.pid, signal.SIGSTOP)   # no request on it: its health probe finds it
        stopped = time.monotonic()
        assert eventually(lambda: _stats(base)["in_rotation"] == [0], timeout=15, every=0.1)
        assert time.monotonic() - stopped < 10          # probe interval 1 s + 5 s to answer
        assert "health probe not answered within 5 s" in _stats(base)["replicas"][1]["reason"]
        assert [c["text"] for c in _complete(base, ["a", "b", "c"])["choices"]] == ["a", "b", "c"]  # on r0 whole
        os.kill(replicas[1].proc.pid, signal.SIGCONT)   # healthy again: back after two passing probes
        assert eventually(lambda: _stats(base)["in_rotation"] == [0, 1], timeout=15, every=0.1)
        assert eventually(lambda: re.search(r"replica 1 \(127\.0\.0\.1:\d+\) back in rotation after [\d.]+ s; 2 of 2 in "
                                            r"rotation", Path(router.log_path).read_text()), timeout=10, every=0.1)

        # the launcher swaps in a new engine at a new address for replica 1, held until it is restored
        [spare] = _stubs(tmp_path, 1, first=2)
        answer = router_client.control(router.address, 1, "replace", address=spare.address, hold=True)
        assert answer["membership"] == 1 and answer["replica"]["address"] == spare.address
        assert eventually(lambda: _stats(base)["replicas"][1]["passes"] >= 2, timeout=15, every=0.1)
        assert _stats(base)["in_rotation"] == [0]       # healthy, but held: still out
        router_client.control(router.address, 1, "restore")
        assert _stats(base)["in_rotation"] == [0, 1]    # at once: its probes passed
        for k in range(4):
            _complete(base, f"n{k}")
        assert len(_prompts_of(tmp_path, "r2")) == 2 and "n0" not in _prompts_of(tmp_path, "r1")
        # removed (say, the launcher is about to stop it): out, its requests elsewhere, until restored
        router_client.control(router.address, 0, "remove", reason="the launcher stops it")
        stats = _stats(base)
        assert stats["in_rotation"] == [1] and stats["replicas"][0]["reason"] == "the launcher stops it"
        _complete(base, "m0")
        assert "m0" in _prompts_of(tmp_path, "r2")
        router_client.control(router.address, 0, "restore")
        assert eventually(lambda: _stats(base)["in_rotation"] == [0, 1], timeout=15, every=0.1)  # 2 probes passed
        # a bad control request is refused with one line
        with pytest.raises(RuntimeError, match="refused replace of replica 1: replace needs {'address': 'host:port'}"):
            router_client.control(router.address, 1, "replace", address="nowhere")
        with pytest.raises(RuntimeError, match="no replica 7: this router has 2"):
            router_client.control(router.address, 7, "restore")
        assert requests.get(f"{base}/health", timeout=10, proxies={"http": None}).json()["in_rotation"] == 2
    finally:
        _stop(router, *replicas, *([spare] if spare else []))


def test_the_weight_transfer_follows_the_members_and_a_held_replacement_serves_after_its_first_update(tmp_path):
    """No replica serves stale weights, as the router sees it: the launcher removes a dead replica (the membership
    grows, the weight-transfer calls and the world size leave it out), replaces it held (the membership grows
    again: the trainer re-forms its group), and the router restores it once it received and finished an update.
    (No init here, so the group's calls go to the members of now; a group formed by an init: test_router_weight_sync.py.)"""
    import requests

    from dualrun.contract.protocol import ROUTER_MEMBERSHIP_PATH

    rec = tmp_path / "rec"
    rec.mkdir()

    def stub(i: int):   # REPLICAS=1: each answers the collective calls alone (the members change here)
        return _server(f"r{i}", [sys.executable, str(ASSETS / "recording_replica.py"), str(free_port()), "1",
                                 str(rec), f"r{i}"], tmp_path / f"r{i}.log", env={"REPLICAS": "1"})

    def calls(name: str) -> list:
        return [r["path"] for r in _recorded(rec, name) if r["method"] == "POST"]

    def sync() -> None:
        for path in ("/start_weight_update", "/update_weights", "/finish_weight_update"):
            assert _post(base, path, {}).status_code == 200, path

    replicas = _start_all([stub(0), stub(1)])
    router = _router(tmp_path, replicas)
    base = f"http://{router.address}"
    spare = None
    members = lambda: requests.get(base + ROUTER_MEMBERSHIP_PATH, timeout=10, proxies={"http": None}).json()  # noqa
    world = lambda: requests.get(base + "/get_world_size", timeout=10, proxies={"http": None}).json()  # noqa: E731
    try:
        assert members() == {"membership": 0, "members": [0, 1], "group": [0, 1]} and world() == {"world_size": 2}
        replicas[1].stop(grace_s=0)
        router_client.control(router.address, 1, "remove", reason="died; being restarted")
        assert members() == {"membership": 1, "members": [0], "group": [0]} and world() == {"world_size": 1}
        sync()                                          # the survivor alone
        assert calls("r0")[-3:] == ["/start_weight_update", "/update_weights", "/finish_weight_update"]
        assert "/start_weight_update" not in calls("r1")

        [spare] = _start_all([stub(2)])
        router_client.control(router.address, 1, "replace", address=spare.address, hold=True)
        assert members() == {"membership": 2, "members": [0, 1], "group": [0, 1]} and world() == {"world_size": 2}
        assert eventually(lambda: _stats(base)["replicas"][1]["passes"] >= 2, timeout=15, every=0.1)
        _complete(base, ["a", "b"])
        assert _stats(base)["in_rotation"] == [0] and _prompts_of(tmp_path, "r2") == []   # healthy, held
        assert _post(base, "/shutdown_weight_transfer_engine", {}).status_code == 200      # the group re-formed
        assert "/shutdown_weight_transfer_engine" in calls("r0") and "/shutdown_weight_transfer_engine" in calls("r2")
        sync()
        assert _stats(base)["in_rotation"] == [0, 1]   # at once: its probes had passed
        assert eventually(lambda: re.search(   # the router's log reaches its file through a reader thread
            r"replica 1 \(127\.0\.0\.1:\d+\) holds the trainer's weights \(its first update completed\); "
            r"replica 1 \(127\.0\.0\.1:\d+\) back in rotation", Path(router.log_path).read_text()), timeout=10, every=0.1)
        _complete(base, ["c", "d"])
        assert _prompts_of(tmp_path, "r2") == ["d"] or _prompts_of(tmp_path, "r2") == ["c"]
    finally:
        _stop(router, *replicas, *([spare] if spare else []))
