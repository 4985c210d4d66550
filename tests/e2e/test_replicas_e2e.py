"""Engine replicas behind one router, end to end on CPU with the built-in engine: 2 and 3 replicas on both backends
serve real TRL GKD's teacher, and a 4-engine GRPO rollout serves TRL's own client built from the unchanged
GRPOConfig; every replica gets requests (counted in each replica's own log or stats). With `replica_restarts: 0` a
replica killed mid-training ends the job within 10 s naming it (both backends; the rollout's on Ray),
and so does the last replica serving (both killed) with the default; with max_failures: 1 the job restarts with
fresh replicas and a fresh router and finishes. By default a killed teacher replica is restarted while GKD goes on
(on Ray a fresh actor and placement group); one SIGSTOPped after it (hung, alive) is routed around by the router,
then stopped and restarted by the launcher; the losses equal the run without either."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import ASSETS, cmdline, dualrun, engine_pid, eventually, link_tiny, pids_matching
from ray_helpers import ray_env
from test_server_watch import STEPS, assert_restarted_once

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
def cluster(ray_cluster):
    """This worker's running cluster (conftest): 8 CPUs, for 2 trainers + 3 replicas + the router (or 1 + 4 + 1)."""
    return ray_cluster


def _yaml(tiny: Path, replicas: int, max_failures: int = 0, teacher: str = "") -> str:
    return (f"use_cpu: true\nmethod: gkd\nmax_failures: {max_failures}\nlog_dir: logs\nroles:\n  train: {{gpus: 2}}\n"
            f"  teacher: {{gpus: {replicas}, model: {tiny / 'teacher'}, top_k: 5, health_timeout_s: 120, {teacher}"
            "server_args: [--verbose]}\n")


def _gkd(tmp_path: Path, tiny: Path, replicas: int, backend: str = "torchrun", env: dict | None = None,
         steps: int = 2) -> dict:
    (tmp_path / "job.yaml").write_text(_yaml(tiny, replicas))
    (tmp_path / "out").mkdir()
    proc = dualrun("launch", "--backend", backend, "--config_file", "job.yaml", str(ASSETS / "gkd_probe.py"),
                   "--model_name_or_path", str(tiny / "model"), "--teacher_model_name_or_path", str(tiny / "teacher"),
                   "--data", str(tiny / "data" / "gkd.jsonl"), "--output_dir", "out", "--max_steps", str(steps),
                   cwd=tmp_path,
                   env={"TRL_EXPERIMENTAL_SILENCE": "1", **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / "out" / f"rank{i}.json").read_text()) for i in range(2)]
    assert [r["teacher"] for r in ranks] == ["RemoteTeacher"] * 2             # GKDTrainer's teacher: the role's
    assert len({r["teacher_address"] for r in ranks}) == 1                    # one address for every rank
    assert ranks[0]["losses"] == ranks[1]["losses"]                           # DDP: one loss
    logs = tmp_path / "logs"
    served = [(logs / f"teacher-server-{i}.log").read_text().count('"POST /v1/completions') for i in range(replicas)]
    return {"losses": ranks[0]["losses"], "address": ranks[0]["teacher_address"], "served": served,
            "stderr": proc.stderr, "logs": logs}


RESTART_STEPS = 6


@pytest.fixture(scope="module")
def unkilled(module_tiny, tmp_path_factory) -> dict:
    """GKD on a 3-replica teacher under torchrun for RESTART_STEPS steps, nothing killed: the first case of
    test_replicas_serve_the_teacher, and the losses every restart test below must give (the teacher is
    deterministic, whichever replica answers: a run whose replica died and came back must give exactly these)."""
    return _gkd(tmp_path_factory.mktemp("unkilled"), module_tiny, 3, "torchrun", steps=RESTART_STEPS)


@pytest.mark.parametrize("backend, replicas", [("torchrun", 3), ("ray", 2)])
def test_replicas_serve_the_teacher(tmp_path, module_tiny, ray_cluster_if_ray, backend, replicas, request):
    """(That a router's greedy answers are one engine's, for 2 and 3 replicas, is test_router.py's.)"""
    cluster = ray_cluster_if_ray
    env = ray_env(RAY_ADDRESS=cluster.address) if cluster else None
    got = _gkd(tmp_path, module_tiny, replicas, backend, env) if cluster else request.getfixturevalue("unkilled")
    assert all(n >= 1 for n in got["served"]), got["served"]           # every replica got scoring requests
    router_log = (got["logs"] / "teacher-router.log").read_text()
    assert f"serving http://{got['address']} for {replicas} replicas" in router_log  # the trainers' one address
    spread = re.search(r"served per replica: \[([\d, ]+)\]", router_log)      # its last line, when stopped
    assert spread and [int(n) >= 1 for n in spread.group(1).split(",")] == [True] * replicas, router_log[-500:]
    assert f"teacher: server healthy at {got['address']}" in got["stderr"]
    assert len(got["losses"]) == (2 if cluster else RESTART_STEPS) and all(x == x and x >= 0 for x in got["losses"])
    assert eventually(lambda: not _engines(module_tiny))                        # the replicas are stopped
    if cluster:
        assert eventually(lambda: not cluster.alive_actors()) and eventually(lambda: not cluster.live_placement_groups())


# -- a replica dies ----------------------------------------------------------------------------------------------
def _start(tmp_path: Path, tiny: Path, backend: str, max_failures: int, cluster,
           teacher: str = "replica_restarts: 0, ") -> subprocess.Popen:
    (tmp_path / "job.yaml").write_text(_yaml(tiny, 2, max_failures, teacher=teacher))  # 0: no replica restarts
    (tmp_path / "out").mkdir()
    env = dict(os.environ, **ray_env(RAY_ADDRESS=cluster.address if cluster else ""))
    return subprocess.Popen([sys.executable, "-m", "dualrun", "launch", "--backend", backend, "--config_file",
                             "job.yaml", str(ASSETS / "uses_teacher.py"), str(tmp_path / "out"), str(STEPS)],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _replica_pid(tmp_path: Path, replica: int) -> int:
    text = (tmp_path / "logs" / f"teacher-server-{replica}.log").read_text()
    return engine_pid(text)


def _kill_replica_mid_training(tmp_path: Path, driver: subprocess.Popen, replica: int) -> float:
    out = tmp_path / "out"
    assert eventually(lambda: (out / "step_0_1").exists() and (out / "step_1_1").exists(), timeout=150), \
        driver.stderr.read() if driver.poll() is not None else "no step yet"
    os.kill(_replica_pid(tmp_path, replica), signal.SIGKILL)
    return time.monotonic()


def _engines(tiny: Path) -> list[int]:
    return [p for p in pids_matching(str(tiny / "teacher")) if "cpu_engine" in cmdline(p)]


def _router_pids(tmp_path: Path, attempt: int = 0) -> list[int]:
    host, _, port = json.loads((tmp_path / "out" / f"address_{attempt}_0.json").read_text()).rpartition(":")
    return pids_matching(f"dualrun.programs.router --host {host} --port {port} ")


@pytest.mark.parametrize("backend, last", [("torchrun", False), ("ray", False), ("torchrun", True), ("ray", True)])
def test_a_dead_replica_ends_the_job_within_10_s_naming_it(tmp_path, module_tiny, ray_cluster_if_ray, backend, last):
    """`replica_restarts: 0`: one dead replica ends the job. `last`: the default
    budget, but both replicas killed at once: the one left to serve is gone, so the job ends too."""
    cluster = ray_cluster_if_ray
    driver = _start(tmp_path, module_tiny, backend, 0, cluster, teacher="" if last else "replica_restarts: 0, ")
    killed = _kill_replica_mid_training(tmp_path, driver, 1)
    if last:
        os.kill(_replica_pid(tmp_path, 0), signal.SIGKILL)
    assert _router_pids(tmp_path), "the trainers' address is the router's"
    code = driver.wait(timeout=60)
    took = time.monotonic() - killed
    err = driver.stderr.read()
    assert code == 1, err[-3000:]
    assert took < 10, f"{took:.1f} s\n{err[-3000:]}"
    named = r"dualrun: error: teacher server [01] exited with code -9 \(killed by SIGKILL\) while the job was running"
    assert re.search(named if last else named.replace("[01]", "1"), err), err[-3000:]
    assert "--- last lines of its log ---" in err
    assert ("restarting it on the same devices" in err) == last   # the first of the two, while the other served
    assert "restarting the job" not in err
    assert eventually(lambda: not pids_matching(str(tmp_path / "out")))   # trainers, router, replicas are gone
    assert eventually(lambda: not _router_pids(tmp_path))
    assert eventually(lambda: not _engines(module_tiny))
    if cluster:
        assert eventually(lambda: not cluster.alive_actors()) and eventually(lambda: not cluster.live_placement_groups())


def test_max_failures_restarts_with_fresh_replicas_and_router(tmp_path, module_tiny):
    driver = _start(tmp_path, module_tiny, "torchrun", 1, None)
    _kill_replica_mid_training(tmp_path, driver, 0)
    assert_restarted_once(driver, tmp_path / "out", "teacher server 0")   # the trainers' address: a fresh router
    assert eventually(lambda: not _engines(module_tiny))


def _held_gkd_job(tmp_path: Path, tiny: Path, teacher: str, steps: int, backend: str = "torchrun",
                  cluster=None) -> tuple[subprocess.Popen, Path]:
    """A GKD job on a 2-replica teacher (`teacher`: extra keys of the role), started in the background with its
    stderr in stderr.txt (a file: a full pipe never blocks the job); its trainers wait after step 2 while the
    returned hold file exists (it does at the start)."""
    (tmp_path / "job.yaml").write_text(_yaml(tiny, 2, teacher=teacher))
    (tmp_path / "out").mkdir()
    hold_file = tmp_path / "hold"
    hold_file.touch()
    env = dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1", **ray_env(RAY_ADDRESS=cluster.address if cluster else ""))
    with open(tmp_path / "stderr.txt", "w") as errors:
        driver = subprocess.Popen([sys.executable, "-m", "dualrun", "launch", "--backend", backend,
                                   "--config_file", "job.yaml",
                                   str(ASSETS / "gkd_probe.py"), "--model_name_or_path", str(tiny / "model"),
                                   "--teacher_model_name_or_path", str(tiny / "teacher"), "--data",
                                   str(tiny / "data" / "gkd.jsonl"), "--output_dir", "out", "--max_steps", str(steps),
                                   "--hold_file", str(hold_file), "--hold_at_step", "2"],
                                  cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=errors, text=True)
    return driver, hold_file


def _losses(tmp_path: Path, steps: int) -> list[float]:
    """Every step's loss, the same on both ranks (DDP)."""
    losses = [json.loads((tmp_path / "out" / f"rank{i}.json").read_text())["losses"] for i in range(2)]
    assert len(losses[0]) == steps and losses[0] == losses[1] and all(x == x and x >= 0 for x in losses[0]), losses
    return losses[0]


def _back(tmp_path: Path, driver: subprocess.Popen, replica: int, timeout: float) -> bool:
    """Wait until the launcher says teacher replica `replica` is back in rotation (or the job ended)."""
    return eventually(lambda: driver.poll() is not None or f"teacher server {replica} is back in rotation" in
                      (tmp_path / "stderr.txt").read_text(), timeout=timeout)


@pytest.mark.parametrize("backend", ["torchrun", "ray"])
def test_a_dead_then_a_hung_teacher_replica_are_restarted_and_gkd_finishes(tmp_path, module_tiny, ray_cluster_if_ray,
                                                                           backend, unkilled):
    """The default `replica_restarts`, one GKD job (one run instead of two: each costs a minute on 2 cores):
    1. dead: teacher replica 1 SIGKILLed once it has served is restarted on a fresh port while GKD goes on, and its
       router takes it back (on Ray a fresh actor and placement group, the dead one's gone);
    2. hung: then replica 0 is SIGSTOPped (alive, never answers; the launcher sees a live process): the router's
       health probes take it out of rotation and a request on it goes to the other replica; out that long
       (`request_timeout_s: 10`), the launcher stops it and restarts it, and the router takes it back.
    The job ends 0 with every step's loss, the same on both ranks and equal to the run without either, no restart
    of the job; the launch's stderr names each death and each return. (The trainers wait after step 2 until both
    are back, so that each serves again on 2 busy cores: `--hold_file`.)"""
    cluster = ray_cluster_if_ray
    driver, hold = _held_gkd_job(tmp_path, module_tiny, "request_timeout_s: 10, ", RESTART_STEPS, backend, cluster)
    logs = tmp_path / "logs"
    stderr = lambda: (tmp_path / "stderr.txt").read_text()  # noqa: E731
    stopped = None
    try:
        assert eventually(lambda: driver.poll() is not None or all(
            (logs / f"teacher-server-{i}.log").exists() and '"POST /v1/completions' in
            (logs / f"teacher-server-{i}.log").read_text() for i in (0, 1)), timeout=200, every=0.05)
        assert driver.poll() is None, stderr()[-3000:]
        assert pids_matching("dualrun.programs.router", "--request-timeout-s 10")   # the role's key, passed on
        killed = _replica_pid(tmp_path, 1)
        os.kill(killed, signal.SIGKILL)
        assert _back(tmp_path, driver, 1, timeout=120), stderr()[-3000:]
        if cluster:   # a fresh actor in a fresh placement group; the dead one's are gone
            groups = [p["name"] for p in cluster.live_placement_groups()]
            actors = [a["Name"] for a in cluster.alive_actors()]
            for names in (groups, actors):
                assert [n for n in names if "teacher-server-1" in n][0].endswith("-teacher-server-1-0-r1"), names
                assert not [n for n in names if n.endswith("-teacher-server-1-0")], names
        stopped = _replica_pid(tmp_path, 0)
        os.kill(stopped, signal.SIGSTOP)
        assert _back(tmp_path, driver, 0, timeout=150), stderr()[-3000:]
        hold.unlink()
        code = driver.wait(timeout=240)
    finally:
        if stopped is not None and cmdline(stopped):
            os.kill(stopped, signal.SIGCONT)
        if driver.poll() is None:
            driver.kill()
    err = stderr()
    assert code == 0, err[-3000:]
    assert "restarting the job" not in err
    assert _losses(tmp_path, RESTART_STEPS) == unkilled["losses"]
    # 1. the dead one
    assert re.search(r"dualrun: teacher server 1 exited with code -9 \(killed by SIGKILL\) while the job was "
                     r"running.*; restarting it on the same devices \(restart 1 of 3, replica_restarts\)\n", err), \
        err[-3000:]
    assert re.search(r"dualrun: teacher server 1 is back in rotation at [\d.]+:\d+, [\d.]+ s after it died \(its "
                     r"engine started in [\d.]+ s while the others served\)",
                     err), err[-3000:]
    text = (logs / "teacher-server-1.log").read_text()   # the restarted engine appends to the dead one's log
    assert engine_pid(text) != killed and '"POST /v1/completions' in text[text.rfind("dualrun engine: loading"):]
    # 2. the hung one
    assert not cmdline(stopped)                                                  # the hung engine was stopped
    assert re.search(r"dualrun: teacher server 0 is hung \(.+\); stopping it \(SIGTERM, then SIGKILL after 5 s\)\n",
                     err), err[-3000:]
    assert re.search(r"dualrun: teacher server 0 was hung \(.+\).*; restarting it on the same devices \(restart 1 of 3",
                     err), err[-3000:]
    assert re.search(r"dualrun: teacher server 0 is back in rotation at [\d.]+:\d+", err), err[-3000:]
    router_log = (logs / "teacher-router.log").read_text()
    for i in (1, 0):
        assert re.search(rf"replica {i} \([\d.]+:\d+\) out of rotation: ", router_log), router_log[-2000:]
    assert eventually(lambda: not _engines(module_tiny))
    if cluster:
        assert eventually(lambda: not cluster.alive_actors()) and eventually(lambda: not cluster.live_placement_groups())


# -- a 4-engine GRPO rollout behind one address ------------------------------------------------------------------
ROLLOUT_ENGINES = 4


@pytest.fixture(scope="module")
def rollout_tiny(tiny, tmp_path_factory) -> Path:
    """The shared assets under this module's own path: the model path on the engines' command lines is this
    module's marker (see helpers.link_tiny)."""
    return link_tiny(tiny, tmp_path_factory.mktemp("rollout"))


def _rollout_job(tmp_path: Path, tiny: Path, backend: str, cluster, *probe_args: str,
                 role_extra: str = "") -> tuple[subprocess.Popen, Path]:
    (tmp_path / "job.yaml").write_text(
        "use_cpu: true\nmethod: grpo\nlog_dir: logs\nroles:\n  train: {gpus: 1}\n"
        f"  rollout: {{gpus: {ROLLOUT_ENGINES}, tensor_parallel_size: 1, model: {tiny / 'model'}, "
        f"engine: transformers, health_timeout_s: 120{role_extra}}}\n")
    (tmp_path / "out").mkdir()
    env = dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1",
               **ray_env(RAY_ADDRESS=cluster.address if cluster else ""))
    err = tmp_path / "stderr.txt"
    with open(tmp_path / "stdout.txt", "w") as out, open(err, "w") as errors:   # files: a full pipe never blocks
        proc = subprocess.Popen([sys.executable, "-m", "dualrun", "launch", "--backend", backend, "--config_file",
                                 "job.yaml", str(ASSETS / "grpo_rollout_load.py"), str(tiny / "model"),
                                 str(tiny / "data" / "prompts.jsonl"), "out", *probe_args],
                                cwd=tmp_path, env=env, stdout=out, stderr=errors, text=True)
    return proc, err


def _assert_four_engines_served(tmp_path: Path, err: str) -> str:
    """What the probe saw (grpo_rollout_load.py): one address, the router's, for four replicas that all served
    GRPO's load, answering like one engine. The router's address."""
    for i in range(ROLLOUT_ENGINES):   # the plan, the launch's first line
        assert f"rollout server {i}\n" in err, err[:2000]
    assert "rollout router\n" in err
    assert f"starting 1 train worker, {ROLLOUT_ENGINES} rollout servers, 1 rollout router on" in err
    address = re.search(r"rollout: server healthy at ([\d.]+:\d+)", err).group(1)
    router_log = (tmp_path / "logs" / "rollout-router.log").read_text()
    assert f"serving http://{address} for {ROLLOUT_ENGINES} replicas" in router_log
    rec = json.loads((tmp_path / "out" / "rank0.json").read_text())
    grpo = rec["grpo"]
    assert grpo["use_vllm"] and grpo["vllm_mode"] == "server" and grpo["vllm_server_base_url"] is None
    assert f"{grpo['vllm_server_host']}:{grpo['vllm_server_port']}" == address
    assert len(rec["replicas"]) == ROLLOUT_ENGINES and address not in rec["replicas"]
    assert rec["world_size"] == ROLLOUT_ENGINES                          # the replicas' world sizes summed
    got, want = rec["got"], rec["want"]
    assert len(got["completion_ids"]) == 16                              # 8 prompts x num_generations 2
    assert (got["prompt_ids"], got["completion_ids"]) == (want["prompt_ids"], want["completion_ids"])
    flat = lambda lps: [x for seq in lps for step in seq for x in step]  # noqa: E731
    assert flat(got["logprobs"]) == pytest.approx(flat(want["logprobs"]), abs=1e-5)
    assert rec["single"] == rec["want_single"] == want["completion_ids"][:8:2]
    assert all(n >= 1 for n in rec["served"]), rec["served"]             # every replica served
    assert sum(rec["served"]) == ROLLOUT_ENGINES + 4 and sum(rec["prompts"]) == 8 + 4, rec
    return address


def _nothing_left(tmp_path: Path, tiny: Path, address: str, cluster) -> None:
    host, _, port = address.rpartition(":")
    assert eventually(lambda: not pids_matching(str(tmp_path / "out")))            # the trainer
    assert eventually(lambda: not pids_matching(f"dualrun.programs.router --host {host} --port {port} "))
    assert eventually(lambda: not pids_matching(str(tiny / "model"), "cpu_engine"))
    if cluster:
        assert eventually(lambda: not cluster.alive_actors()) and eventually(lambda: not cluster.live_placement_groups())


def test_a_four_engine_rollout_serves_grpo_behind_one_address_torchrun(tmp_path, rollout_tiny):
    proc, err = _rollout_job(tmp_path, rollout_tiny, "torchrun", None)
    code = proc.wait(timeout=240)
    text = err.read_text()
    assert code == 0, text[-3000:]
    address = _assert_four_engines_served(tmp_path, text)
    _nothing_left(tmp_path, rollout_tiny, address, None)


def test_a_four_engine_rollout_on_ray_and_a_dead_replica_ends_the_job_within_10_s(tmp_path, rollout_tiny, cluster):
    """The same load on Ray (an actor and placement group per replica, the router in a CPU actor); then one
    replica is SIGKILLed while the trainer still runs: the job ends within 10 s naming it, nothing left."""
    proc, err = _rollout_job(tmp_path, rollout_tiny, "ray", cluster, "--then-wait",
                             role_extra=", replica_restarts: 0")   # a dead replica ends the job
    try:
        assert eventually(lambda: (tmp_path / "out" / "generated").exists() or proc.poll() is not None,
                          timeout=200)
        assert proc.poll() is None, err.read_text()[-3000:]
        address = _assert_four_engines_served(tmp_path, err.read_text())
        victim = 2
        log = (tmp_path / "logs" / f"rollout-server-{victim}.log").read_text()
        os.kill(engine_pid(log), signal.SIGKILL)
        killed = time.monotonic()
        code = proc.wait(timeout=60)
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
    text = err.read_text()
    assert code == 1, text[-3000:]
    assert took < 10, f"{took:.1f} s\n{text[-3000:]}"
    assert (f"dualrun: error: rollout server {victim} exited with code -9 (killed by SIGKILL) while the job was "
            "running") in text
    assert "--- last lines of its log ---" in text and "dualrun engine" in text.split("last lines of its log")[-1]
    _nothing_left(tmp_path, rollout_tiny, address, cluster)
