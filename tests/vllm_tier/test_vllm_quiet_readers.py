"""vLLM's shared-memory queue readers, in a vLLM process dualrun marks, wait for the writer's signal instead of
spinning (dualrun/servers/quiet_readers.py): vLLM's own class, and a real vLLM CPU engine started from dualrun's plan,
in vLLM's default layout (API server, engine core, worker), whose processes rest in the second after a request
(vLLM's readers spin through that second: one core each, taken from the trainer ranks on a CPU machine)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time


from helpers import pids_matching
from vllm_helpers import SERVER_ARGS, TIER
from dualrun.contract import protocol

pytestmark = TIER

READERS = r"""
import json, sys, threading, time
import zmq
from dualrun.servers import quiet_readers
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

applied = quiet_readers.apply()
context = zmq.Context()
writer = SpinCondition(False, context, "ipc://" + sys.argv[1])
reader = SpinCondition(True, context, "ipc://" + sys.argv[1])
time.sleep(0.5)                         # the reader's subscription is in place
reader.record_read()                    # it has just read a message; nothing more is written for a second:
cpu, t0 = time.process_time(), time.monotonic()
while time.monotonic() - t0 < 1.0:      # vLLM's read loop, waiting (a quiet reader sleeps, vLLM's yields)
    reader.wait(timeout_ms=30000)
rest_cpu_s = time.process_time() - cpu
written = threading.Event()
threading.Timer(0.3, lambda: (written.set(), writer.notify())).start()
t0 = time.monotonic()
while not written.is_set():             # a message comes: the loop sees it
    reader.wait(timeout_ms=30000)
print(json.dumps({"applied": applied, "busy_loop_s": reader.busy_loop_s, "rest_cpu_s": rest_cpu_s,
                  "woke": time.monotonic() - t0}))
"""


def _readers(tmp_path, marked: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != protocol.QUIET_READERS}
    if marked:
        env[protocol.QUIET_READERS] = "1"
    proc = subprocess.run([sys.executable, "-c", READERS, str(tmp_path / "notify")], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_marked_process_s_readers_sleep_between_checks_and_see_the_next_message(tmp_path):
    from dualrun.servers.quiet_readers import BUSY_LOOP_S

    got = _readers(tmp_path, marked=True)
    assert got["applied"] is True and got["busy_loop_s"] == BUSY_LOOP_S, got
    assert got["rest_cpu_s"] < 0.4, got   # a second of waiting cost little CPU (vLLM's spin: all of a free core)
    assert got["woke"] < 25, got          # the message's signal ended the wait loop


def test_an_unmarked_process_keeps_vllm_s_readers(tmp_path):
    got = _readers(tmp_path, marked=False)
    assert got["applied"] is False and got["busy_loop_s"] == 1, got   # vLLM's own second


def _tree_cpu_s(pid: int) -> float:
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for p in [root, *root.children(recursive=True)]:
        try:
            times = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def test_a_vllm_cpu_engine_from_the_plan_rests_after_a_request(tmp_path, vllm_tiny):
    import requests
    import yaml

    from dualrun.config import build_config
    from dualrun.methods.plugin import get_plugin
    from dualrun.plan.processes import make_plan
    from dualrun.servers.local import LocalServers
    from dualrun.plan.server_commands import with_method

    rollout = {"gpus": 1, "engine": "vllm", "model": str(vllm_tiny / "model"), "health_timeout_s": 300,
               "server_args": yaml.safe_load(SERVER_ARGS),
               "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}}
    cfg = build_config({"use_cpu": True, "method": "grpo", "log_dir": str(tmp_path),
                        "roles": {"train": {"gpus": 1}, "rollout": rollout}}, str(tmp_path / "job.yaml"))
    grpo = get_plugin("grpo")
    plan = with_method(make_plan(cfg, method=grpo), cfg, grpo)
    assert plan.servers[0].env[protocol.QUIET_READERS] == "1"
    servers = LocalServers(plan, lambda p: dict(os.environ, **p.env), stream=None)
    with servers:
        address = servers.start()["rollout"]
        pid = servers.running[0].proc.pid
        url = f"http://{address}"
        model = requests.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
        spent = []
        for _ in range(3):
            # a few hundred messages each way: a reader that slept past one would hang the request
            reply = requests.post(f"{url}/v1/completions", timeout=120, json={
                "model": model, "prompt": [2, 10, 11], "max_tokens": 64, "n": 4, "ignore_eos": True})
            assert reply.status_code == 200, reply.text[-2000:]
            assert [len(c["text"]) > 0 for c in reply.json()["choices"]] == [True] * 4
            before = _tree_cpu_s(pid)
            time.sleep(1.0)
            spent.append(_tree_cpu_s(pid) - before)
        # vLLM's spinning readers (the worker after the call, the engine core after the worker's answer) spend up
        # to a core each through this second; resting processes next to nothing
        assert min(spent) < 0.3, spent
    assert not pids_matching(str(tmp_path), open_files=True), "a vLLM process outlived its server set"
