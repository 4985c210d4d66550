"""Forming the trainer<->vLLM weight-sync group is bounded (issue 49): `weight_sync_timeout_s` (default 120 s)
reaches both ends through DUALRUN_WEIGHT_SYNC_TIMEOUT_S in the plan (the trainers' env and the rollout servers',
whose vLLM workers inherit it), and the line that ends the job names both ends. The group that cannot form, on a
real vLLM server, is tests/vllm_tier/test_vllm_weight_sync_bound.py."""
from __future__ import annotations

from concurrent.futures import Future

import pytest

from dualrun.config import build_config
from dualrun.contract import protocol
from dualrun.contract.errors import ConfigError
from dualrun.plan.placement import Cluster
from dualrun.methods.plugin import get_plugin
from dualrun.plan.processes import make_plan
from dualrun.weightsync.trainer.vllm_client import answer, not_formed_line
from dualrun.weightsync.wire import FORM_TIMEOUT_ENV, FORM_TIMEOUT_S, form_timeout_s

GRPO = {"method": "grpo", "roles": {"train": {"gpus": 1}, "rollout": {"gpus": 1, "engine": "vllm", "model": "m"}}}


def test_the_default_and_the_key_reach_both_ends_of_the_group():
    assert FORM_TIMEOUT_ENV == protocol.WEIGHT_SYNC_TIMEOUT_S and FORM_TIMEOUT_S == 120
    for raw, expected in ((GRPO, "120"), ({**GRPO, "weight_sync_timeout_s": 30}, "30")):
        cfg = build_config(raw, "job.yaml")
        plan = make_plan(cfg, Cluster.uniform(1, 2), method=get_plugin("grpo"))
        ends = [p for p in plan.processes if p.kind == "worker" or "rollout" in p.roles]
        assert len(ends) == 2 and {p.env[protocol.WEIGHT_SYNC_TIMEOUT_S] for p in ends} == {expected}


def test_a_job_without_a_weight_sync_group_gets_no_bound():
    cfg = build_config({"roles": {"train": {"gpus": 2}}}, "job.yaml")
    assert all(protocol.WEIGHT_SYNC_TIMEOUT_S not in p.env
               for p in make_plan(cfg, Cluster.uniform(1, 2), method=get_plugin("sft")).processes)


@pytest.mark.parametrize("value", [0, -5, "soon", 10 ** 9])
def test_a_bad_bound_is_refused_naming_the_key(value):
    with pytest.raises(ConfigError, match=r"job\.yaml: weight_sync_timeout_s: expected"):
        build_config({**GRPO, "weight_sync_timeout_s": value}, "job.yaml")


def test_each_end_reads_the_bound_from_its_env():
    assert form_timeout_s({}) == FORM_TIMEOUT_S
    assert form_timeout_s({FORM_TIMEOUT_ENV: "45"}) == 45
    assert form_timeout_s({FORM_TIMEOUT_ENV: "nonsense"}) == FORM_TIMEOUT_S


def test_the_line_names_both_ends_and_what_each_said():
    assert not_formed_line("10.0.0.1", 41000, "http://10.0.0.2:8000", 2, 120, "DistNetworkError: timed out\nmore",
                           "no answer") == (
        "the weight-sync group did not form within 120 s (weight_sync_timeout_s): trainer rank 0 at 10.0.0.1:41000 "
        "and the rollout server at http://10.0.0.2:8000 (ranks 1-2 of 3); trainer rank 0: DistNetworkError: timed "
        "out more; the server: no answer")


def test_what_the_server_said_to_the_join():
    refused: Future = Future()
    refused.set_exception(RuntimeError("Request failed: 500, rank 1 of 2 did not form\nthe group"))
    assert answer(refused) == "RuntimeError: Request failed: 500, rank 1 of 2 did not form the group"
    silent: Future = Future()
    assert answer(silent, grace_s=0.01) == "no answer to the join 0.01 s later (its log says its side)"


def test_a_join_the_server_refuses_ends_the_wait_at_once_naming_the_server():
    """The router refused the init (its members changed since the trainer counted them): the group can never form,
    so the trainer does not wait out weight_sync_timeout_s. A group formed, or one that failed, is as before."""
    import time

    from dualrun.weightsync.trainer.vllm_client import first_of
    from dualrun.weightsync.wire import GroupNotFormed

    forming: Future = Future()   # never formed: the other end never joins
    refused: Future = Future()
    refused.set_exception(RuntimeError("Request failed: 400, init_info.world_size 4 cannot hold rank_offset 1 plus "
                                       "the 4 workers of the replicas behind this router ([1, 1, 1, 1])"))
    began = time.monotonic()
    with pytest.raises(GroupNotFormed) as caught:
        first_of(forming, refused, "http://127.0.0.1:8000")
    assert time.monotonic() - began < 5 and caught.value.__cause__ is None
    assert str(caught.value) == ("the rollout server at http://127.0.0.1:8000 refused to join the weight-sync "
                                 "group, so it cannot form: RuntimeError: Request failed: 400, init_info.world_size "
                                 "4 cannot hold rank_offset 1 plus the 4 workers of the replicas behind this router "
                                 "([1, 1, 1, 1])")
    formed, joined = Future(), Future()
    formed.set_result("group")
    assert first_of(formed, joined, "x") == "group"                  # formed first: the join's answer comes after
    failed = Future()
    failed.set_exception(GroupNotFormed("rank 0 of 2 did not form ..."))
    failed.exception().__cause__ = TimeoutError("store")
    with pytest.raises(GroupNotFormed) as caught:
        first_of(failed, Future(), "x")
    assert isinstance(caught.value.__cause__, TimeoutError)          # (the caller's line names both ends)
