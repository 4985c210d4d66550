"""GRPO against a real vLLM rollout server on CPU, on both backends: dualrun starts the command it builds (TRL's
`vllm serve` flags with the gloo weight transfer, dev mode), wires both TRL trainers to it, and the unchanged
GRPOTrainer trains 4 steps, pushing its weights to the server before every generation (dualrun's gloo engine in
vLLM, TRL's client given the gloo path). The probe (assets/grpo_server_probe.py) proves each sync landed: the
server's log-probabilities of a fixed prompt equal the trainer model's and its greedy completion equals the one
the trainer's weights give, and greedy generation changes during training. Both backends give the same losses.
AsyncGRPOTrainer reaches the server and then stops at construction on a CPU (TRL 1.16 reads the CUDA device)."""
from __future__ import annotations

import json
import re

import pytest

from conftest import dualrun
from ray_helpers import ray_env
from vllm_helpers import ASSETS, TIER, assert_nothing_left, server_role, tiny_vllm

pytestmark = [*TIER, pytest.mark.timeout(600)]

LOGPROB_TOLERANCE = 1e-3   # vLLM's CPU kernels against transformers', float32; a missed sync moves far more
RESULTS: dict[str, dict] = {}   # per backend, for the equal-losses check


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_vllm(tmp_path_factory)


def run_grpo_probe(tmp_path, tiny, backend: str, cluster, gpus: int = 1):
    """The probe under a job with a vLLM rollout of `gpus` engines: the finished process, rank 0's record and the
    rollout's address (the router's when there are several engines)."""
    (tmp_path / "job.yaml").write_text("use_cpu: true\nmethod: grpo\nlog_dir: logs\nroles:\n  train: {gpus: 1}\n"
                                       + server_role("rollout", tiny / "model", gpus=gpus, health_timeout_s=400))
    (tmp_path / "out").mkdir()
    proc = dualrun("launch", "--backend", backend, "--config_file", "job.yaml", str(ASSETS / "grpo_server_probe.py"),
                   str(tiny / "model"), str(tiny / "data" / "prompts.jsonl"), "out", cwd=tmp_path,
                   env=ray_env(TRL_EXPERIMENTAL_SILENCE="1", RAY_ADDRESS=cluster.address if cluster else ""),
                   timeout=580)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rec = json.loads((tmp_path / "out" / "rank0.json").read_text())
    address = re.search(r"rollout: server healthy at ([\d.]+:\d+)", proc.stderr).group(1)
    return proc, rec, address


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


@pytest.mark.parametrize("backend", ["torchrun", "ray"])
def test_grpo_trains_against_the_real_rollout_server_with_weights_synced_every_step(tmp_path, tiny, backend,
                                                                                     ray_cluster_if_ray):
    cluster = ray_cluster_if_ray   # Ray: a running cluster
    proc, rec, address = run_grpo_probe(tmp_path, tiny, backend, cluster)
    host, port = address.split(":")
    assert "dualrun gloo weight transfer: rank 1 of 2" in (tmp_path / "logs" / "rollout-server-0.log").read_text()
    assert len(rec["losses"]) == 4 and all(x == x for x in rec["losses"]), rec["losses"]
    assert_every_sync_landed(rec, replicas=1)
    assert rec["async_url"] == f"http://{address}"
    assert rec["async_server"] == {"dtype": "torch.float32", "world_size": 1}
    assert "CUDA" in rec["async_error"]  # TRL 1.16's AsyncGRPOTrainer reads the CUDA device name when built
    grpo = rec["grpo"]
    assert grpo["use_vllm"] and grpo["vllm_mode"] == "server"
    assert (grpo["vllm_server_host"], grpo["vllm_server_port"]) == (host, int(port))
    assert grpo["vllm_group_port"] not in (51216, int(port))
    assert_nothing_left(proc.stderr, str(tmp_path))
    if cluster:
        cluster.assert_nothing_left()
    RESULTS[backend] = rec
    if len(RESULTS) == 2:   # both backends ran in this session: the same training
        torchrun, ray = RESULTS["torchrun"], RESULTS["ray"]
        assert torchrun["losses"] == pytest.approx(ray["losses"], abs=1e-6)
        assert torchrun["rewards"] == ray["rewards"]   # the same completions were sampled (seeded) and scored
        assert [c["trainer_greedy"] for c in torchrun["checks"]] == [c["trainer_greedy"] for c in ray["checks"]]
        assert [c["moved"] for c in torchrun["checks"][1:]] == pytest.approx([c["moved"] for c in ray["checks"][1:]],
                                                                             abs=1e-5)   # the same updates
