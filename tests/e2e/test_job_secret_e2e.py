"""A hostile client on the job's machine, end to end: a GKD job on a 2-replica CPU-engine teacher behind the router,
held after step 2, on both backends. Every socket the job's processes listen on is on loopback (the servers, the
rendezvous store: torchrun's agent's, rank 0's on Ray); the requests that would point the teacher elsewhere or take
a replica out (`POST /router/replicas/N/replace|remove`), or pause the replicas or push weights through it, are
answered 401 without the job's secret and 403 with a guessed one, the router's table stays as it was, the job's
losses equal those of the run nobody attacked, and the secret (read from the router's env) is in no output or log.
The teacher's `server_args` give an `--api-key`: the router and each replica answer inference 401 without it and
403 with a wrong one; the trainers' requests carry it (the job trains), and it is in no output or log either."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from dualrun.contract import protocol
from helpers import ASSETS, cmdline, eventually, pids_matching
from test_job_secret import on_every_interface
from ray_helpers import ray_env
from test_replicas_e2e import RESTART_STEPS, _losses, unkilled  # noqa: F401 - unkilled: a fixture

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(480)]

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


KEY = "users-own-api-key-value"


def _held_job(tmp_path: Path, tiny: Path, backend: str, cluster) -> tuple[subprocess.Popen, Path]:
    """GKD on a 2-replica CPU-engine teacher whose `server_args` give an `--api-key`, in the background (stderr in
    stderr.txt); its trainers wait after step 2 while the returned hold file exists (it does at the start)."""
    (tmp_path / "job.yaml").write_text(
        f"use_cpu: true\nmethod: gkd\nlog_dir: logs\nroles:\n  train: {{gpus: 2}}\n"
        f"  teacher: {{gpus: 2, model: {tiny / 'teacher'}, top_k: 5, health_timeout_s: 120, "
        f"server_args: [--verbose, --api-key, {KEY}]}}\n")
    (tmp_path / "out").mkdir()
    hold = tmp_path / "hold"
    hold.touch()
    env = dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1", **ray_env(RAY_ADDRESS=cluster.address if cluster else ""))
    with open(tmp_path / "stderr.txt", "w") as errors:
        driver = subprocess.Popen([sys.executable, "-m", "dualrun", "launch", "--backend", backend, "--config_file",
                                   "job.yaml", str(ASSETS / "gkd_probe.py"), "--model_name_or_path",
                                   str(tiny / "model"), "--teacher_model_name_or_path", str(tiny / "teacher"),
                                   "--data", str(tiny / "data" / "gkd.jsonl"), "--output_dir", "out", "--max_steps",
                                   str(RESTART_STEPS), "--hold_file", str(hold), "--hold_at_step", "2"],
                                  cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=errors, text=True)
    return driver, hold


def _post(url: str, body: dict, headers: dict | None = None) -> int:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with _OPENER.open(request, timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def _table(router: str) -> dict:
    with _OPENER.open(f"http://{router}/router/stats", timeout=30) as resp:
        return json.loads(resp.read())


def listening(pids: list[int]) -> dict[int, list[str]]:
    """pid -> the `address:port` (hex, as /proc/net/tcp writes it) of each TCP socket it listens on."""
    inodes: dict[str, int] = {}
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes[target[8:-1]] = pid
        except OSError:
            continue
    found: dict[int, list[str]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                found.setdefault(inodes[fields[9]], []).append(fields[1])
    return found


def _env_of(pid: int) -> dict[str, str]:
    raw = open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace")
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


@pytest.mark.parametrize("backend", ["torchrun", "ray"])
def test_a_hostile_client_on_the_machine_changes_nothing(tmp_path, module_tiny, ray_cluster_if_ray, backend, unkilled):
    cluster = ray_cluster_if_ray
    driver, hold = _held_job(tmp_path, module_tiny, backend, cluster)
    stderr = lambda: (tmp_path / "stderr.txt").read_text()  # noqa: E731
    try:
        assert eventually(lambda: driver.poll() is not None or Path(f"{hold}.held0").exists(), timeout=300), \
            stderr()[-3000:]
        assert driver.poll() is None, stderr()[-3000:]
        serving = re.search(r"serving http://(\S+) for 2 replicas: (\S+) (\S+)",
                            (tmp_path / "logs" / "teacher-router.log").read_text())
        assert serving, stderr()[-3000:]
        router, replicas = serving.group(1), [serving.group(2), serving.group(3)]
        # 1. the job listens on loopback alone: its servers, and the rendezvous store (torchrun: the launcher's agent)
        job = set(pids_matching(str(module_tiny))) | set(pids_matching("dualrun.programs.router", router.split(":")[1]))
        if backend == "torchrun":
            job |= set(_descendants(driver.pid))
        sockets = listening(sorted(job))
        everywhere = {pid: on_every_interface(a) for pid, a in sockets.items() if on_every_interface(a)}
        assert not everywhere, {pid: cmdline(pid)[:200] for pid in everywhere}
        ports = {int(a.split(":")[1], 16) for a in sum(sockets.values(), [])}
        assert {int(a.split(":")[1]) for a in [router, *replicas]} <= ports, (sockets, router, replicas)
        if backend == "torchrun":
            assert sockets.get(driver.pid), "the agent's rendezvous store is the launcher's"
        # 2. the requests of a local user who is not the job
        base = f"http://{router}/router/replicas"
        assert _post(f"{base}/0/replace", {"address": replicas[1]}) == 401
        assert _post(f"{base}/1/replace", {"address": replicas[0]}, {"X-Dualrun-Job-Token": "guessed"}) == 403
        assert _post(f"{base}/1/remove", {"reason": "hostile"}) == 401
        assert _post(f"{base}/0/restore", {}, {"Authorization": "Bearer guessed"}) == 401
        assert _post(f"http://{router}/pause", {}) == 401 and _post(f"http://{router}/update_weights", {}) == 401
        table = _table(router)
        assert [r["address"] for r in table["replicas"]] == replicas and table["in_rotation"] == [0, 1], table
        # 3. the user's --api-key: required by the router and by each replica on inference, as vLLM does
        completion = {"prompt": "hello", "max_tokens": 2, "temperature": 0}
        for server in (router, *replicas):
            assert _post(f"http://{server}/v1/completions", completion) == 401, server
            assert _post(f"http://{server}/v1/completions", completion, {"Authorization": "Bearer guessed"}) == 403
        assert _post(f"http://{router}/v1/completions", completion, {"Authorization": f"Bearer {KEY}"}) == 200
        secret = _env_of(pids_matching("dualrun.programs.router", router.split(":")[1])[0])[protocol.JOB_TOKEN]
        assert len(secret) >= 40
        hold.unlink()
        code = driver.wait(timeout=300)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert code == 0, stderr()[-3000:]
    assert _losses(tmp_path, RESTART_STEPS) == unkilled["losses"]
    shown = [stderr(), *(f.read_text(errors="replace") for f in (tmp_path / "logs").iterdir() if f.is_file())]
    assert not [text for text in shown if secret in text or KEY in text]   # never printed, nor logged
