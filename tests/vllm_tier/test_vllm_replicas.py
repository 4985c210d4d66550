"""Two real vLLM CPU engines behind dualrun's router: `{gpus: 2, engine: vllm}` on CPU is two replicas (one vLLM
engine per process) behind one address.
- A GKD teacher: the unchanged GKDTrainer distils from the router's address for a few steps, both replicas answer
  scoring requests, and everything is stopped with nothing left behind.
- A GRPO rollout with one replica SIGKILLed mid-run: the unchanged GRPOTrainer's weights reach every replica in
  rotation at every step, over one gloo group of world size 1 + 2 (the trainer rank 0, the replicas at rank offsets
  1 and 2, as the router's fan-out gives them); restarted, the killed one serves only once it holds the trainer's
  weights. The kill changes nothing in the training: both backends sample the same completions and log the same
  losses, bit for bit.
- A replica killed mid-run with `max_failures: 1`: the job restarts with fresh replicas and router, the trainer
  resumes from its checkpoint, and after their first sync the fresh replicas serve the checkpoint's weights (which
  they did not load); AsyncGRPOTrainer's weight transfer, fanned out by the fresh router, lands in both. The resumed
  job samples and trains as the same job never interrupted, bit for bit."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from helpers import ASSETS, cmdline, eventually, pids_matching
from ray_helpers import ray_env
from vllm_helpers import (LOGPROB_TOLERANCE, TIER, assert_async_syncs_landed, assert_nothing_left, run_gkd_probe,
                          run_grpo_probe, server_role)

pytestmark = [*TIER, pytest.mark.timeout(600)]

KILLED: dict[str, dict] = {}   # the killed-replica run's record per backend


def test_gkd_distils_from_two_vllm_replicas_behind_the_router(tmp_path, vllm_tiny):
    job = ("use_cpu: true\nmethod: gkd\nlog_dir: logs\nroles:\n  train: {gpus: 1}\n"
           + server_role("teacher", vllm_tiny / "teacher", gpus=2, health_timeout_s=400, top_k=5,
                         processes=True))   # vLLM binds a worker process's threads (below): its own process
    proc, rank = run_gkd_probe(tmp_path, vllm_tiny, job, timeout=580)
    assert all(x == x and x >= 0 for x in rank["losses"])
    router_log = (tmp_path / "logs" / "teacher-router.log").read_text()
    assert f"serving http://{rank['teacher_address']} for 2 replicas" in router_log
    spread = re.search(r"served per replica: \[(\d+), (\d+)\]", router_log)
    assert spread and all(int(n) >= 1 for n in spread.groups()), router_log[-500:]
    cores = []
    for i in (0, 1):   # each replica is a real vLLM server, its OpenMP threads on cores of its own
        log = (tmp_path / "logs" / f"teacher-server-{i}.log").read_text()
        assert "vllm" in log.lower()
        bound = re.search(r"local_rank=0, core ids=\[([\d, ]+)\]", log)
        assert bound, log[-4000:]
        cores.append(bound.group(1))
    assert cores[0] != cores[1], cores   # vLLM's own "auto" binding gives both the same core
    assert_nothing_left(proc.stderr, str(vllm_tiny / "teacher"))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", ["torchrun", "ray"])
def test_a_killed_rollout_replica_is_restarted_and_serves_only_once_it_holds_the_trainers_weights(
        tmp_path, vllm_tiny, backend, ray_cluster_if_ray):
    """GRPO on 2 vLLM replicas, replica 1 SIGKILLed at step 2 (`replica_restarts` by default): the launcher takes it
    out of the weight-transfer group, the trainer re-forms the group without it at the next sync (replica 0 alone,
    world size 2), the restarted engine joins it at the sync after it is healthy (world size 3) held out of rotation,
    and the router restores it once that update completed: its log-probabilities then equal the trainer's, far from
    the initial model's, and it served no generation before (its own access log, its router's log)."""
    (tmp_path / "job.yaml").write_text("use_cpu: true\nmethod: grpo\nlog_dir: logs\nroles:\n  train: {gpus: 1}\n"
                                       + server_role("rollout", vllm_tiny / "model", gpus=2, health_timeout_s=400,
                                                     processes=backend == "torchrun"))
    (tmp_path / "out").mkdir()
    err = tmp_path / "stderr.txt"
    with open(err, "w") as errors:
        ray = ray_cluster_if_ray.address if ray_cluster_if_ray else ""
        driver = subprocess.Popen([sys.executable, "-m", "dualrun", "launch", "--backend", backend, "--config_file",
                                   "job.yaml", str(ASSETS / "grpo_replica_restart_probe.py"), str(vllm_tiny / "model"),
                                   str(vllm_tiny / "data" / "prompts.jsonl"), "out"],
                                  cwd=tmp_path, env=dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1",
                                                         **ray_env(RAY_ADDRESS=ray)),
                                  stdout=subprocess.DEVNULL, stderr=errors, text=True)
    try:
        marker = tmp_path / "out" / "kill_now"
        assert eventually(lambda: marker.exists() or driver.poll() is not None, timeout=500, every=0.5)
        assert driver.poll() is None, err.read_text()[-4000:]
        port = marker.read_text().rpartition(":")[2]
        [victim] = [p for p in pids_matching("vllm", "--port", port) if f"--port {port} " in cmdline(p) + " "]
        os.kill(victim, signal.SIGKILL)
        code = driver.wait(timeout=360)
    finally:
        if driver.poll() is None:
            driver.kill()
    text = err.read_text()
    assert code == 0, text[-4000:]
    assert re.search(r"dualrun: rollout server 1 exited with code -9 \(killed by SIGKILL\) while the job was running"
                     r".*; restarting it on the same devices \(restart 1 of 3, replica_restarts\)\n", text), \
        text[-3000:]
    assert re.search(r"dualrun: rollout server 1 is healthy again at [\d.]+:\d+; out of rotation until it holds the "
                     r"trainer's weights", text)
    assert text.count("re-forming the weight-sync group before this sync") == 2, text[-3000:]   # without it, with it
    assert re.search(r"dualrun: rollout server 1 is back in rotation at [\d.]+:\d+, [\d.]+ s after it died", text)
    rec = json.loads((tmp_path / "out" / "rank0.json").read_text())
    assert len(rec["losses"]) == 5
    removed, rejoined, restored = (rec["rows"][k][1] for k in ("removed", "rejoined", "restored"))
    assert not removed["member"] and not removed["in_rotation"]
    assert rejoined["member"] and rejoined["hold"] and not rejoined["in_rotation"] and rejoined["incarnation"] == 1
    assert restored["in_rotation"] and not restored["hold"]
    for c in rec["checks"]:   # every replica in rotation, at every step: the trainer's weights of the last sync
        assert c["gap"] < LOGPROB_TOLERANCE, rec["checks"]
    first = next(c for c in rec["checks"] if c["replica"] == 1 and c["incarnation"] == 1)
    assert first["step"] == 4 and first["from_initial"] > 100 * LOGPROB_TOLERANCE, rec["checks"]   # not stale
    assert [c["replica"] for c in rec["checks"] if c["step"] == 3] == [0]   # meanwhile replica 0 alone served
    logs = tmp_path / "logs"
    survivor = (logs / "rollout-server-0.log").read_text()
    assert [int(n) for n in re.findall(r"dualrun gloo weight transfer: rank 1 of (\d+)", survivor)] == [3, 2, 3]
    restarted = (logs / "rollout-server-1.log").read_text()
    new = restarted[[m.start() for m in re.finditer(r"Started server process \[", restarted)][-1]:]
    assert new.find('"POST /finish_weight_update') > 0
    assert '"POST /v1/completions' not in new[:new.find('"POST /finish_weight_update')], new[-3000:]
    assert '"POST /v1/completions' in new   # and it served once restored
    assert "rollout sampling: each prompt seeded" not in text   # the script's own seed: TRL's request, untouched
    KILLED[backend] = rec
    if len(KILLED) == 2:   # the other backend ran too: the same training, whichever replicas served
        assert KILLED["torchrun"]["generations"] == KILLED["ray"]["generations"]
        assert KILLED["torchrun"]["losses"] == KILLED["ray"]["losses"]
    router_log = (logs / "rollout-router.log").read_text()
    replaced = router_log.find("replica 1 replaced:")
    assert 0 < replaced < router_log.find("replica 1 (", replaced) and re.search(
        r"replica 1 \([\d.:]+\) holds the trainer's weights \(its first update completed\)", router_log[replaced:])
    assert_nothing_left(text, str(tmp_path))


# torchrun only: the Ray case passes too (add "ray"), but costs ~5.5 min on 2 cores against ~3 min here; the Ray
# restart path of one replica is the test above
@pytest.mark.timeout(900)   # the restarted job, then the uninterrupted one
@pytest.mark.parametrize("backend", ["torchrun"])
def test_grpo_resumes_after_a_replica_dies_and_the_fresh_replicas_get_the_trainers_weights(
        tmp_path, vllm_tiny, backend, ray_cluster_if_ray):
    """GRPO, 2 replicas, `max_failures: 1`: replica 0 is SIGKILLed while the trainer waits at the start of
    step 2 (checkpoint-2 written). The job restarts with fresh engines, the trainer resumes at step 2, and the first
    sync (over a new gloo group through a new router) gives both fresh engines the trainer's weights. Before it the
    restarted attempt syncs through AsyncGRPOTrainer's weight transfer (a perturbed model, then the loaded one),
    fanned out by the router to both engines (world size 1 + 2)."""
    ray = ray_cluster_if_ray.address if ray_cluster_if_ray else ""
    (tmp_path / "job.yaml").write_text("use_cpu: true\nmethod: grpo\nmax_failures: 1\nlog_dir: logs\nroles:\n"
                                       "  train: {gpus: 1}\n"   # replica_restarts 0: the whole job restarts
                                       + server_role("rollout", vllm_tiny / "model", gpus=2, health_timeout_s=400,
                                                     replica_restarts=0))
    (tmp_path / "out").mkdir()
    hold = tmp_path / "hold"
    hold.touch()
    with open(tmp_path / "stderr.txt", "w") as errors:
        driver = subprocess.Popen([sys.executable, "-m", "dualrun", "launch", "--backend", backend, "--config_file",
                                   "job.yaml", str(ASSETS / "grpo_server_probe.py"), str(vllm_tiny / "model"),
                                   str(vllm_tiny / "data" / "prompts.jsonl"), "out", "--restart_test",
                                   "--max_steps", "3", "--hold_file", str(hold), "--hold_at_step", "2"],
                                  cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=errors, text=True,
                                  env=dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1", **ray_env(RAY_ADDRESS=ray)))
    err = lambda: (tmp_path / "stderr.txt").read_text()  # noqa: E731
    try:
        assert eventually(lambda: driver.poll() is not None or os.path.exists(f"{hold}.held"), timeout=450), err()
        assert driver.poll() is None, err()[-4000:]
        log = (tmp_path / "logs" / "rollout-server-0.log").read_text()
        os.kill(int(re.findall(r"Started server process \[(\d+)\]", log)[-1]), signal.SIGKILL)
        hold.unlink()
        code = driver.wait(timeout=450)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert code == 0, err()[-4000:]
    assert "rollout server 0 exited with code -9 (killed by SIGKILL) while the job was running" in err()
    assert "restarting the job" in err() and "after 1 restart(s)" in err()
    rec = json.loads((tmp_path / "out" / "rank0.json").read_text())
    assert (rec["attempt"], rec["start_step"]) == (1, 2), rec   # the restarted trainer resumed from checkpoint-2
    for i in (0, 1):   # each engine joined the first attempt's group, and each fresh one the restarted attempt's
        log = (tmp_path / "logs" / f"rollout-server-{i}.log").read_text()   # two (async, then GRPO's), at its offset
        assert log.count(f"dualrun gloo weight transfer: rank {i + 1} of 3") == 3, log[-2000:]
    assert rec["async_server"]["world_size"] == 2   # the router sums the replicas' world sizes
    assert_async_syncs_landed(rec, replicas=2)
    trained = rec["start_logprobs"]   # the checkpoint's weights, which no fresh engine loaded ...
    assert all(max(abs(x - y) for x, y in zip(loaded[1:], trained[1:])) > 100 * LOGPROB_TOLERANCE
               for loaded in rec["initial_logprobs"]), rec
    [check] = rec["checks"]           # ... and which both serve after their first sync
    assert check["step"] == 3 and len(check["logprob_gap"]) == 2, check
    assert max(check["logprob_gap"]) < LOGPROB_TOLERANCE and check["greedy"] == [check["trainer_greedy"]] * 2, check
    assert max(rec["one_tensor"]["logprob_gap"]) < LOGPROB_TOLERANCE, rec["one_tensor"]
    assert_nothing_left("", str(tmp_path))
    if ray_cluster_if_ray:
        ray_cluster_if_ray.assert_nothing_left()
    # the same job never interrupted (one engine: the replica count changes no sample): the resumed attempt sampled
    # at step 3 what it sampled there, and the losses of the three steps are its, bit for bit
    (tmp_path / "uninterrupted").mkdir()
    _, whole, _ = run_grpo_probe(tmp_path / "uninterrupted", vllm_tiny, "torchrun", None,
                                 probe_args=("--restart_test", "--max_steps", "3"))
    assert len(rec["generations"]) == 1 and rec["generations"] == whole["generations"][-1:], "step 3 sampled apart"
    assert rec["losses"] == whole["losses"] and len(whole["losses"]) == 3, (rec["losses"], whole["losses"])
