"""The trainer's side of a changed rollout membership (dualrun/weightsync/trainer/regroup.py): when TRL's weight-sync group is formed
again before a sync. The rule is pure; the steps are checked on a stand-in for TRL's client that records them (the
real client against real vLLM replicas, one killed and restarted: test_vllm_replicas.py)."""
from __future__ import annotations

import pytest

from dualrun.contract.protocol import ROUTER_MEMBERSHIP_PATH
from dualrun.weightsync.trainer import regroup
from dualrun.weightsync.trainer.regroup import needs_reform


def test_the_group_is_formed_again_only_when_the_routers_membership_changed_outside_an_update():
    assert needs_reform(0, 1, has_group=True, updating=False)
    assert not needs_reform(1, 1, has_group=True, updating=False)        # the same members
    assert not needs_reform(0, 1, has_group=False, updating=False)       # no group yet: init forms it
    assert not needs_reform(0, 1, has_group=True, updating=True)         # inside TRL's weight_update(): next call
    assert not needs_reform(None, None, has_group=True, updating=False)  # one engine, no router


class _Answer:
    def __init__(self, status: int, payload: dict) -> None:
        self.status_code, self.payload, self.text = status, payload, str(payload)

    def json(self) -> dict:
        return self.payload


class _Client:
    """What regroup touches of TRL's VLLMClient; the router's answers are canned, the steps recorded."""

    base_url = "http://127.0.0.1:9"

    def __init__(self, answers: list[_Answer]) -> None:
        self.answers, self.steps = answers, []
        self.communicator, self._updating_weights, self.group_port = object(), False, 5000
        self.session = self

    def get(self, url: str, timeout: float) -> _Answer:
        assert url == self.base_url + ROUTER_MEMBERSHIP_PATH
        return self.answers.pop(0)

    def close_communicator(self) -> None:
        self.steps.append("close")
        self.communicator = None

    def _post(self, url: str, json: dict) -> dict:
        self.steps.append(url.removeprefix(self.base_url))
        return {}

    def init_communicator(self, device) -> None:
        regroup.remember(self, device)
        self.steps.append(("init", device, self.group_port))
        self.communicator = object()


def test_a_changed_membership_closes_the_group_has_the_members_leave_it_and_forms_it_on_a_fresh_port():
    client = _Client([_Answer(200, {"membership": 0}), _Answer(200, {"membership": 0}),
                      _Answer(200, {"membership": 1}), _Answer(200, {"membership": 1})])
    regroup.remember(client, "cpu")
    assert not regroup.reform_if_changed(client) and client.steps == []   # unchanged
    assert regroup.reform_if_changed(client)
    assert client.steps[:2] == ["close", "/shutdown_weight_transfer_engine"]
    (_, device, port), = client.steps[2:]
    assert device == "cpu" and port != 5000
    assert client.answers == []   # the new group's membership was read when it was formed


def test_one_engine_without_a_router_is_left_alone_and_a_router_error_is_one_line():
    client = _Client([_Answer(404, {})])
    regroup.remember(client, 0)
    assert not regroup.reform_if_changed(client) and client.steps == []
    broken = _Client([_Answer(200, {"membership": 0}), _Answer(502, {"error": "down"})])
    regroup.remember(broken, 0)
    with pytest.raises(RuntimeError, match=r"the rollout router at http://127.0.0.1:9 answered 502 to "
                                           r"/router/membership"):
        regroup.reform_if_changed(broken)
