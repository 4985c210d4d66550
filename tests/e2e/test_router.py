"""The router: several engine replicas behind one address. Real processes on loopback: CPU-engine replicas (the
router's answers equal one engine's, every replica gets requests) and recording replicas (the weight-transfer
fan-out at the protocol level: world size, rank offsets, every call to every replica at once, health)."""
from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dualrun.programs import routing
from helpers import ASSETS, eventually, free_port

pytestmark = pytest.mark.timeout(240)

PROMPTS = ["what is 1 plus 2 ?", [1, 5, 9], "the big cat sees a small dog .", [3, 4], "what is 7 minus 3 ?",
           [8, 8, 2, 6], "tell me about the river ."]


# -- pure logic ----------------------------------------------------------------------------------------------
def test_chunks_cover_every_prompt_in_order():
    assert routing.chunks(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert routing.chunks(2, 3) == [(0, 1), (1, 2)]
    assert routing.chunks(1, 4) == [(0, 1)]
    for count in range(1, 12):
        for replicas in range(1, 5):
            parts = routing.chunks(count, replicas)
            assert [i for a, b in parts for i in range(a, b)] == list(range(count))
            assert max(b - a for a, b in parts) - min(b - a for a, b in parts) <= 1


def test_merge_renumbers_choices_and_sums_usage():
    parts = [(0, {"id": "a", "choices": [{"index": 0, "t": "p0a"}, {"index": 1, "t": "p0b"}],
                  "usage": {"prompt_tokens": 3, "completion_tokens": 4}}),
             (1, {"id": "b", "choices": [{"index": 0, "t": "p1a"}, {"index": 1, "t": "p1b"}],
                  "usage": {"prompt_tokens": 2, "completion_tokens": 1}})]
    merged = routing.merge_completions(parts, n=2)
    assert [c["index"] for c in merged["choices"]] == [0, 1, 2, 3]
    assert [c["t"] for c in merged["choices"]] == ["p0a", "p0b", "p1a", "p1b"]
    assert merged["usage"] == {"prompt_tokens": 5, "completion_tokens": 5} and merged["id"] == "a"


def test_rank_offsets_and_init_bodies():
    assert routing.rank_offsets([1, 2, 4], first=1) == [1, 2, 4]
    bodies = routing.init_bodies({"init_info": {"rank_offset": 1, "world_size": 8, "master_port": 5}}, [1, 2, 4])
    assert [b["init_info"]["rank_offset"] for b in bodies] == [1, 2, 4]
    assert all(b["init_info"]["world_size"] == 8 and b["init_info"]["master_port"] == 5 for b in bodies)
    with pytest.raises(ValueError, match="cannot hold rank_offset 1 plus the 7 workers"):
        routing.init_bodies({"init_info": {"rank_offset": 1, "world_size": 7}}, [1, 2, 4])
    with pytest.raises(ValueError, match="is more than rank_offset 1 plus the 7 workers"):   # ranks no one holds
        routing.init_bodies({"init_info": {"rank_offset": 1, "world_size": 9}}, [1, 2, 4])
    with pytest.raises(ValueError, match="needs"):
        routing.init_bodies({}, [1])


def test_routes_cover_trl_client_endpoints():
    assert routing.route("GET", "/health/") == routing.HEALTH
    assert routing.route("POST", "/v1/completions") == routing.SPLIT
    assert routing.route("GET", "/server_info?config_format=json") == routing.FIRST
    assert routing.route("POST", "/sleep") is None
    assert routing.route("POST", "/pause?mode=keep") == routing.route("POST", "/resume") == routing.ALL
    assert "POST /update_weights" in routing.unknown_endpoint("POST", "/sleep")
    assert routing.prompts_of({"prompt": [1, 2]}) is None and routing.prompts_of({"prompt": "x"}) is None
    assert routing.prompts_of({"prompt": [[1], "x"]}) == [[1], "x"]


# -- processes -------------------------------------------------------------------------------------------------
def _server(label, argv, log, env=None):
    from dualrun.servers.process import ServerProcess

    port = int(argv[argv.index("--port") + 1]) if "--port" in argv else int(argv[2])
    return ServerProcess(label, argv, dict(os.environ, **(env or {})), "127.0.0.1", port, "/health", 120.0,
                         str(log), stream=None)


def _start_all(servers):
    for s in servers:
        s.start()
    try:
        for s in servers:
            s.wait_healthy()
    except BaseException:
        for s in servers:
            s.stop(grace_s=2)
        raise
    return servers


def _router(replicas, log):
    from dualrun.plan.server_commands import router_argv

    return _start_all([_server("router", router_argv("127.0.0.1", free_port(), replicas), log)])[0]


@pytest.fixture(scope="module")
def engines(tmp_path_factory, tiny):
    """Three CPU-engine replicas of the tiny model, each logging every request it serves."""
    from dualrun.config.model import RoleSpec
    from dualrun.methods.commands import cpu_engine

    logs = tmp_path_factory.mktemp("engines")
    role = RoleSpec("rollout", 1, 1, server_args=("--verbose",))
    servers = [_server(f"rollout server {i}", cpu_engine(role, str(tiny / "model"), "127.0.0.1", free_port()),
                       logs / f"engine{i}.log") for i in range(3)]
    yield _start_all(servers)
    for s in servers:
        s.stop(grace_s=5)


def _served(server) -> int:
    return Path(server.log_path).read_text().count('"POST /v1/completions')


def _post(url, payload):
    import requests

    r = requests.post(url, json=payload, timeout=60, proxies={"http": None})
    assert r.status_code == 200, r.text
    return r.json()


def _same_choices(got, want):
    """The same answers bit for bit: each prompt is computed alone, whichever replica and batch-mates it has."""
    assert [c["index"] for c in got] == [c["index"] for c in want]
    for g, w in zip(got, want):
        assert (g["token_ids"], g["text"], g["prompt_token_ids"]) == (w["token_ids"], w["text"], w["prompt_token_ids"])
        assert g["logprobs"] == w["logprobs"]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("count", [2, 3])
def test_router_spreads_requests_and_answers_like_one_engine(engines, tmp_path, count):
    from dualrun.rank.teacher import teacher_client

    replicas = engines[:count]
    router = _router([s.address for s in replicas], tmp_path / "router.log")
    try:
        base, direct = f"http://{router.address}", f"http://{replicas[0].address}"
        via, one = teacher_client(base), teacher_client(direct)
        body = {"model": "m", "prompt": PROMPTS, "max_tokens": 5, "temperature": 0, "logprobs": 2}
        sampled = {**body, "temperature": 1.0, "n": 2, "seed": 11}   # every prompt seeded 11, as one engine does
        ids = [[1, 5, 9, 12, 7], [2, 8, 8], [4, 4, 6, 1, 9, 3]]
        single = [{"prompt": p, "max_tokens": 3, "temperature": 0} for p in PROMPTS]
        # one engine's answers first, so that what the replicas serve next is the router's traffic only
        want = _post(f"{direct}/v1/completions", body)
        want_sampled = _post(f"{direct}/v1/completions", sampled)
        want_ids = one.generate(ids, temperature=0.0, max_tokens=4)["completion_ids"]
        ref = one.get_sequence_logprobs(ids, [1, 1, 1], top_logprobs=3)
        want_single = [_post(f"{direct}/v1/completions", b)["choices"][0]["token_ids"] for b in single]
        time.sleep(0.5)
        before = [_served(s) for s in replicas]

        got = _post(f"{base}/v1/completions", body)  # many prompts in one request: split, reassembled in order
        assert len(got["choices"]) == len(PROMPTS)
        _same_choices(got["choices"], want["choices"])
        assert got["usage"] == want["usage"]
        _same_choices(_post(f"{base}/v1/completions", sampled)["choices"], want_sampled["choices"])
        # TRL's own client through the router: generation, and teacher scoring (prompt logprobs)
        assert via.generate(ids, temperature=0.0, max_tokens=4)["completion_ids"] == want_ids
        assert via.get_sequence_logprobs(ids, [1, 1, 1], top_logprobs=3) == ref
        # single-prompt requests, many at once (as TRL's client sends them): spread too
        with ThreadPoolExecutor(4) as pool:
            singles = list(pool.map(lambda b: _post(f"{base}/v1/completions", b), single))
        assert [a["choices"][0]["token_ids"] for a in singles] == want_single

        deadline = time.monotonic() + 5  # the log lines reach the files through each server's tee thread
        while True:
            served = [_served(s) - b for s, b in zip(replicas, before)]
            if sum(served) >= 4 * count + len(PROMPTS) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert sum(served) == 4 * count + len(PROMPTS), served  # 4 split requests + the single ones
        assert all(n >= 4 for n in served), served  # every replica got a part of each split request at least
        import requests

        stats = requests.get(f"{base}{routing.STATS_PATH}", timeout=5, proxies={"http": None}).json()["replicas"]
        assert [r["address"] for r in stats] == [s.address for s in replicas]
        assert all(r["errors"] == 0 and r["in_flight"] == 0 for r in stats)
    finally:
        router.stop(grace_s=5)


@pytest.mark.e2e
@pytest.mark.slow
def test_trls_client_seeded_by_dualrun_samples_alike_on_one_engine_and_behind_the_router(engines, tmp_path):
    """TRL's VLLMClient as a trainer rank has it (dualrun's per-prompt seeds, no seed of the user's): two fresh
    clients (two runs) sample the same completions call for call, on one engine and through a router over 3
    replicas (each prompt to whichever is least busy); each call and each prompt draws its own."""
    import types

    import torch
    from trl.generation import vllm_client

    from dualrun.rank import rollout_seeds
    from dualrun.rank.teacher import teacher_client

    module = types.SimpleNamespace(VLLMClient=type("Seeded", (vllm_client.VLLMClient,), {}))  # TRL's class stays
    lines = []
    rollout_seeds.install(module, lines.append)
    torch.manual_seed(3)   # the trainer's seed (Trainer sets it)
    prompts = [[1, 5, 9], [2, 4], [1, 5, 9], [3, 4, 5, 6, 7], [8, 8, 2, 6]]

    def client(address):
        c = teacher_client(f"http://{address}")   # TRL's client, built without vLLM's import check
        c.__class__ = module.VLLMClient
        return c

    def run(address):
        c = client(address)
        return [c.generate(prompts, n=2, max_tokens=5, logprobs=0) for _ in range(2)]

    router = _router([s.address for s in engines], tmp_path / "router.log")
    try:
        one, again = run(engines[0].address), run(engines[0].address)
        before = [_served(s) for s in engines]
        routed = run(router.address)
        users = [client(a).generate(prompts, n=2, max_tokens=5, generation_kwargs={"seed": 1})
                 for a in (engines[0].address, router.address)]
    finally:
        router.stop(grace_s=5)
    assert one == again == routed
    first, second = one
    assert first["prompt_ids"] == prompts and len(first["completion_ids"]) == 2 * len(prompts)
    assert first["completion_ids"] != second["completion_ids"]            # a new call: new seeds
    assert first["completion_ids"][0:2] != first["completion_ids"][4:6]   # the same prompt again: its own seed
    assert len(lines) == 1 and "seeded from the trainer's seed" in lines[0]
    assert eventually(lambda: sum(_served(s) for s in engines) - sum(before) >= 2 * len(prompts) + 3, timeout=5)
    assert all(_served(s) > b for s, b in zip(engines, before))         # one request per prompt, spread
    assert users[0] == users[1]   # the user's seed: TRL's one request (split by the router), as on one engine


# -- the weight-transfer protocol with recording replicas --------------------------------------------------------
def _recorded(record_dir, name):
    return [json.loads(line) for line in (record_dir / f"{name}.jsonl").read_text().splitlines()]


@pytest.mark.e2e
@pytest.mark.parametrize("world_sizes", [[1, 2], [2, 1, 2]])
@pytest.mark.slow
def test_weight_transfer_fans_out_with_rank_offsets(tmp_path, world_sizes):
    import requests

    from dualrun.rank.teacher import teacher_client

    rec = tmp_path / "rec"
    rec.mkdir()
    names = [f"r{i}" for i in range(len(world_sizes))]
    replicas = _start_all([
        _server(name, [sys.executable, str(ASSETS / "recording_replica.py"), str(free_port()), str(w), str(rec), name],
                tmp_path / f"{name}.log", env={"REPLICAS": str(len(world_sizes))})
        for name, w in zip(names, world_sizes)])
    router = _router([r.address for r in replicas], tmp_path / "router.log")
    try:
        base = f"http://{router.address}"
        client = teacher_client(base)  # TRL's VLLMClient: /health, /v1/models
        assert client.get_world_size() == sum(world_sizes)
        assert client.get_server_info()["weight_transfer_config"] == {"backend": "nccl"}
        # what VLLMClient.init_communicator sends (the trainer is rank 0, so the servers start at offset 1)
        info = {"master_address": "127.0.0.1", "master_port": 51216, "rank_offset": 1,
                "world_size": client.get_world_size() + 1, "packed": True}
        client._post(f"{base}/init_weight_transfer_engine", json={"init_info": info})
        update = {"names": ["w", "b"], "dtype_names": ["float32", "float32"], "shapes": [[2, 2], [2]], "packed": True}
        with client.weight_update():  # /start_weight_update ... /finish_weight_update
            client._post(f"{base}/update_weights", json={"update_info": update})
            client._post(f"{base}/update_weights", json={"update_info": update})
        client.reset_prefix_cache()
        # AsyncGRPOTrainer's client: generation paused on every engine around an update; adapters on every engine
        from trl.experimental.async_grpo.vllm_client import VLLMClient as AsyncClient

        async_client = AsyncClient(base)
        async_client.pause(timeout=10)
        async_client.start_weight_update(timeout=10)
        async_client.finish_weight_update(timeout=10)
        async_client.resume(timeout=10)
        async_client.load_lora_adapter("policy-v1", "/adapters/v1", timeout=10)
        async_client.unload_lora_adapter("policy-v0", timeout=10)

        offsets = routing.rank_offsets(world_sizes, 1)
        for name, offset in zip(names, offsets):
            posts = [r for r in _recorded(rec, name) if r["method"] == "POST"]
            assert [p["path"] for p in posts] == ["/init_weight_transfer_engine", "/start_weight_update",
                                                  "/update_weights", "/update_weights", "/finish_weight_update",
                                                  "/reset_prefix_cache", "/pause?mode=keep", "/start_weight_update",
                                                  "/finish_weight_update", "/resume", "/v1/load_lora_adapter",
                                                  "/v1/unload_lora_adapter"]
            assert posts[0]["body"]["init_info"] == {**info, "rank_offset": offset}
            assert posts[2]["body"] == {"update_info": update}
            assert posts[10]["body"]["lora_name"] == "policy-v1" and posts[11]["body"] == {"lora_name": "policy-v0"}
        assert offsets[-1] + world_sizes[-1] == info["world_size"]  # the group is exactly full

        # a group too small for every replica is refused before any replica is asked
        r = requests.post(f"{base}/init_weight_transfer_engine", timeout=10, proxies={"http": None},
                          json={"init_info": {**info, "world_size": sum(world_sizes)}})
        assert r.status_code == 400 and "cannot hold" in r.json()["error"]["message"]
        r = requests.post(f"{base}/sleep", timeout=10, proxies={"http": None})
        assert r.status_code == 404 and "does not forward POST /sleep" in r.json()["error"]["message"]

        # a replica whose health probe fails leaves the rotation (test_router_failover.py has the rest): the router
        # is healthy while one is in rotation, naming those that are not; back once their probes pass
        health = lambda: requests.get(f"{base}/health", timeout=10, proxies={"http": None})  # noqa: E731
        (rec / f"{names[-1]}.sick").touch()
        assert eventually(lambda: health().json()["in_rotation"] == len(names) - 1, timeout=10)
        r = health()
        assert r.status_code == 200 and r.json()["problems"] == [
            f"replica {len(names) - 1} ({replicas[-1].address}) out of rotation: health probe answered 503"]
        (rec / f"{names[-1]}.sick").unlink()
        assert eventually(lambda: health().json()["in_rotation"] == len(names), timeout=10)
        for name in names:
            (rec / f"{name}.sick").touch()
        assert eventually(lambda: health().status_code == 503, timeout=10)
        assert len(health().json()["problems"]) == len(names)
    finally:
        router.stop(grace_s=5)
        for r in replicas:
            r.stop(grace_s=2)
