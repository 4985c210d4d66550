"""The ISA probe of a vLLM CPU engine's first logprobs request, made once its worker has warmed its model
(dualrun/servers/warm_first_calls.py): where it acts, that it runs after the warm-up, at the lowest priority, in its
thread alone, and fails silently. vLLM's side: tests/vllm_tier/test_vllm_warm_first_calls.py."""
from __future__ import annotations

import os
import threading
from importlib.metadata import entry_points

from dualrun.contract import protocol
from dualrun.servers import warm_first_calls as w

ENGINE = {protocol.JOB_TOKEN: "secret", protocol.QUIET_READERS: "1"}


def test_it_acts_in_the_workers_of_a_vllm_cpu_engine_dualrun_started_alone():
    assert w.wanted(ENGINE, "VllmWorker-0") and w.wanted(ENGINE, "VllmWorker-3")
    assert not w.wanted(ENGINE, "MainProcess")      # the API server
    assert not w.wanted(ENGINE, "EngineCore")       # samples nothing
    assert not w.wanted({**ENGINE, protocol.QUIET_READERS: ""}, "VllmWorker-0")   # a GPU engine
    assert not w.wanted({**ENGINE, protocol.JOB_TOKEN: ""}, "VllmWorker-0")       # started by hand


def test_vllm_finds_it_among_its_general_plugins():
    found = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert found.get("dualrun_warm_first_calls") == "dualrun.servers.warm_first_calls:apply"


def test_the_probe_runs_at_the_lowest_priority_in_its_thread_alone():
    seen, result = [], []
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = threading.Thread(target=lambda: result.append(w.warm(
        lambda: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))))
    t.start()
    t.join(10)
    assert result == [True] and seen == [w.LOWEST]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before   # this thread kept its own


def test_a_probe_that_fails_or_is_missing_is_silent():
    assert w.warm(lambda: 1 / 0) is False
    assert w.warm(("no.such.module", "f")) is False


def test_the_hook_starts_the_probe_after_the_models_warm_up_once():
    calls, started = [], []

    class Worker:
        def compile_or_warm_up_model(self, x):
            calls.append(("warm-up", x))
            return "times"

    real_start, w.start = w.start, lambda: started.append(len(calls))
    try:
        assert w.after_model_warm_up(Worker) is True
        assert w.after_model_warm_up(Worker) is False   # vLLM loads its plugins more than once
        assert Worker().compile_or_warm_up_model(3) == "times"
    finally:
        w.start = real_start
    assert calls == [("warm-up", 3)] and started == [1]   # after the model's warm-up, not before
    assert w.after_model_warm_up(type("NoWarmUp", (), {})) is False
