"""GRPO against a real vLLM rollout server on CPU, on both backends: dualrun starts the command it builds (TRL's
`vllm serve` flags with the gloo weight transfer, dev mode), wires both TRL trainers to it, and the unchanged
GRPOTrainer trains 4 steps, pushing its weights to the server before every generation (dualrun's gloo engine in
vLLM, TRL's client given the gloo path). The probe (assets/grpo_server_probe.py) proves each sync landed: the
server's log-probabilities of a fixed prompt equal the trainer model's and its greedy completion equals the one
the trainer's weights give, and greedy generation changes during training. The same job run on torchrun, on Ray,
and on torchrun with 2 engines behind the router gives the same training bit for bit: the same completions and
log-probabilities at every step (dualrun seeds each sampled prompt from the trainer's seed), rewards and losses.
AsyncGRPOTrainer reaches the server and then stops at construction on a CPU (TRL 1.16 reads the CUDA device); the
weight transfer it would build is dualrun's gloo client, and its syncs land. GKD's DistillationTrainer trains
against the same server with the same syncs."""
from __future__ import annotations

import pytest

from vllm_helpers import (TIER, assert_async_syncs_landed, assert_every_sync_landed, assert_nothing_left,
                          assert_same_training, run_grpo_probe)

pytestmark = [*TIER, pytest.mark.timeout(600)]

RESULTS: dict[str, dict] = {}   # per run, for the same-training check
# (backend, engines, vLLM's own worker processes): the same job on each launcher, then with 2 engines (in-process
# workers, unbound threads: another process layout and thread binding, which must change nothing either); the first
# is the session's reference run, which tests/vllm_tier/test_vllm_cluster_ray.py compares the same job across Ray
# nodes with
RUNS = [("torchrun", 1, True), ("ray", 1, False), ("torchrun", 2, False)]


@pytest.mark.parametrize("backend, engines, processes", RUNS, ids=[f"{b}-{n}" for b, n, _ in RUNS])
def test_grpo_trains_against_the_real_rollout_server_with_weights_synced_every_step(tmp_path, vllm_tiny, backend,
                                                                                     engines, processes,
                                                                                     ray_cluster_if_ray, request):
    cluster = ray_cluster_if_ray   # Ray: a running cluster
    if (backend, engines, processes) == RUNS[0]:   # the session's reference run (conftest.grpo_one_machine)
        proc, rec, address, tmp_path = request.getfixturevalue("grpo_one_machine")
    else:
        proc, rec, address = run_grpo_probe(tmp_path, vllm_tiny, backend, cluster, gpus=engines, processes=processes)
    host, port = address.split(":")
    for i in range(engines):   # the trainer rank 0 and the engines' workers: one group, its store on loopback alone
        assert (f"dualrun gloo weight transfer: rank {i + 1} of {engines + 1} (trainer at 127.0.0.1:"
                f"{rec['grpo']['vllm_group_port']})" in (tmp_path / "logs" / f"rollout-server-{i}.log").read_text())
    assert len(rec["losses"]) == 4 and all(x == x for x in rec["losses"]), rec["losses"]
    assert_every_sync_landed(rec, replicas=engines)
    assert rec["async_url"] == f"http://{address}"
    assert rec["async_server"] == {"dtype": "torch.float32", "world_size": engines}
    assert "CUDA" in rec["async_error"]  # TRL 1.16's AsyncGRPOTrainer reads the CUDA device name when built
    assert_async_syncs_landed(rec, replicas=engines)   # ... but its weight transfer syncs over gloo
    grpo = rec["grpo"]
    assert grpo["use_vllm"] and grpo["vllm_mode"] == "server"
    assert (grpo["vllm_server_host"], grpo["vllm_server_port"]) == (host, int(port))
    assert grpo["vllm_group_port"] not in (51216, int(port))
    assert "dualrun: rollout sampling: each prompt seeded from the trainer's seed" in proc.stderr
    generations = rec["generations"]   # 2 prompts a step, 2 completions each
    assert len(generations) == 4 and all(len(g["completion_ids"]) == 4 for g in generations), generations
    assert_nothing_left(proc.stderr, str(tmp_path))
    if cluster:
        cluster.assert_nothing_left()
    RESULTS[f"{backend}-{engines}"] = rec
    if len(RESULTS) >= 2:   # the runs so far in this session: the same training, bit for bit
        first, *others = RESULTS.values()
        for other in others:
            assert_same_training(other, first, list(RESULTS))


def test_distillation_trainer_trains_against_the_real_rollout_server_with_weights_synced_every_step(tmp_path,
                                                                                                    vllm_tiny):
    """GKD's on-policy DistillationTrainer (TRL 1.16) generates through the same `VLLMGeneration` and `VLLMClient`
    as GRPO: with a separate rollout (method gkd, the teacher loaded by the trainer) its student's weights reach the
    server over gloo before every generation, and the server serves them."""
    proc, rec, address = run_grpo_probe(tmp_path, vllm_tiny, "torchrun", None, method="gkd",
                                        probe_args=("--teacher", str(vllm_tiny / "teacher")))
    host, port = address.split(":")
    assert "dualrun gloo weight transfer: rank 1 of 2" in (tmp_path / "logs" / "rollout-server-0.log").read_text()
    grpo = rec["grpo"]   # DistillationConfig's fields, filled by dualrun
    assert grpo["use_vllm"] and grpo["vllm_mode"] == "server"
    assert (grpo["vllm_server_host"], grpo["vllm_server_port"]) == (host, int(port))
    assert len(rec["losses"]) == 4 and all(x == x and x >= 0 for x in rec["losses"]), rec["losses"]
    assert_every_sync_landed(rec, replicas=1)
    assert_nothing_left(proc.stderr, str(tmp_path))


@pytest.mark.filterwarnings("ignore:Tensor '2' has size")   # one tensor past the buffer: a chunk alone, on purpose
def test_vllm_loads_the_gloo_engine_and_cuts_packed_chunks_as_dualrun_does():
    """The entry point registers `gloo` when vLLM loads its general plugins, and vLLM's `pack_tensors` (the
    trainer's side) cuts the stream where `chunk_bounds` (the worker's side) expects it. No server."""
    import torch
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors
    from vllm.plugins import load_general_plugins

    from dualrun.weightsync.wire import chunk_bounds
    from dualrun.weightsync.engine.transfer import GlooWeightTransferEngine

    load_general_plugins()
    assert WeightTransferEngineFactory._registry["gloo"]() is GlooWeightTransferEngine
    tensors = [torch.zeros(n, dtype=dt) for n, dt in ((3, torch.float32), (5, torch.bfloat16), (40, torch.float32),
                                                      (1, torch.int64), (2, torch.float32))]
    named = iter([(str(i), t) for i, t in enumerate(tensors)])
    cut = []
    while (chunk := pack_tensors(named, lambda item: item[1], 20)) is not None:
        cut.append(len(chunk.names))
    bounds = chunk_bounds([t.numel() * t.element_size() for t in tensors], 20)
    assert [stop - start for start, stop in bounds] == cut and len(cut) > 1
