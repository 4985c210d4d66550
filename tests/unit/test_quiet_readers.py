"""The plan marks every vLLM CPU engine so that vLLM's shared-memory queue readers wait instead of spinning
(dualrun/servers/quiet_readers.py); the marker is dualrun's alone. vLLM's side:
tests/vllm_tier/test_vllm_quiet_readers.py."""
from __future__ import annotations

import pytest

from dualrun.config import build_config
from dualrun.contract import protocol
from dualrun.contract.errors import ConfigError
from dualrun.plan.processes import make_plan
from dualrun.servers import quiet_readers


def _servers(engine: str, gpus: int = 2, use_cpu: bool = True):
    cfg = build_config({"use_cpu": use_cpu, "method": "gkd",
                        "roles": {"train": {"gpus": 1}, "teacher": {"gpus": gpus, "engine": engine, "model": "m"}}},
                       "x.yaml")
    return [p for p in make_plan(cfg).servers if p.kind == "server"]


@pytest.mark.parametrize("gpus", [1, 2])
def test_every_vllm_cpu_engine_is_marked_alone_or_beside_others(gpus):
    servers = _servers("vllm", gpus)
    assert len(servers) == gpus and all(p.env.get(protocol.QUIET_READERS) == "1" for p in servers)


def test_other_engines_and_gpu_engines_keep_vllm_as_it_is():
    assert all(protocol.QUIET_READERS not in p.env for p in _servers("transformers"))
    assert all(protocol.QUIET_READERS not in p.env for p in _servers("vllm", use_cpu=False))


def test_a_config_cannot_set_the_marker_itself():
    with pytest.raises(ConfigError, match=protocol.QUIET_READERS):
        build_config({"use_cpu": True, "roles": {"train": {"gpus": 1}, "rollout": {
            "gpus": 1, "engine": "vllm", "model": "m", "env": {protocol.QUIET_READERS: "0"}}}, "method": "grpo"},
            "x.yaml")


@pytest.mark.parametrize("value", [None, "", "0", "true"])
def test_without_the_marker_nothing_is_changed(value):
    env = {} if value is None else {protocol.QUIET_READERS: value}
    assert quiet_readers.apply(env) is False


def test_a_quiet_reader_waits_a_millisecond_after_a_message_and_longer_the_longer_it_is_idle():
    bound = quiet_readers.poll_bound_ms
    assert bound(0.0, None) == quiet_readers.FIRST_POLL_MS == 1
    assert bound(0.1, None) == 10 and bound(0.3, None) == 30   # a tenth of the idle time
    assert bound(60.0, None) == quiet_readers.LAST_POLL_MS     # never longer: a lost signal costs little
    assert bound(60.0, 20) == 20 and bound(60.0, 0) == 0        # vLLM's own read timeout comes first
