"""`roles.<r>.replica_restarts`: which dead replicas a job survives (pure rules, milliseconds: the plan's budget,
the supervision table with the clock passed in) and the config's refusals where the key would restart nothing. The
restart itself (a real CPU engine killed and taken back by its router) is test_replicas.py's; a whole GKD job
surviving a kill is test_replicas_e2e.py's."""
from __future__ import annotations

import pytest

from dualrun.config import build_config
from dualrun.contract.errors import ConfigError
from dualrun.plan.processes import make_plan
from dualrun.methods.plugin import get_plugin
from dualrun.servers.supervision import (back_line, held_line, hung, hung_line, restart_budget, restarting_line,
                                        router_of, survivable)


def _cfg(role: str = "teacher", backend: str = "torchrun", **spec) -> object:
    """3 replicas on CPU; a rollout on dualrun's CPU engine, or with `engine: vllm` on 3 GPUs."""
    method = "grpo" if role == "rollout" else "gkd"
    extra = {"engine": "transformers"} if role == "rollout" else {"top_k": 5}
    use_cpu = spec.get("engine") != "vllm"
    top = {k: spec.pop(k) for k in ("num_machines", "main_process_ip") if k in spec}   # the job's, not the role's
    cfg = build_config({"backend": backend, "method": method, "use_cpu": use_cpu, **top, "roles": {
        "train": {"gpus": top.get("num_machines", 1)}, role: {"gpus": 3, "model": "m/m", **extra, **spec}}},
        "job.yaml")
    get_plugin(method).validate(cfg)
    return cfg


def test_each_teacher_replica_gets_the_default_budget_the_router_none():
    plan = make_plan(_cfg())
    assert [p.label for p in plan.servers] == ["teacher server 0", "teacher server 1", "teacher server 2",
                                               "teacher router"]
    assert restart_budget(plan) == {0: 3, 1: 3, 2: 3}
    assert restart_budget(make_plan(_cfg(replica_restarts=1))) == {0: 1, 1: 1, 2: 1}
    assert restart_budget(make_plan(_cfg(replica_restarts=0))) == {}
    assert router_of(plan, 2) == (3, 2)


@pytest.mark.parametrize("backend", ["torchrun", "ray"])
def test_a_vllm_rollout_is_restarted_held_until_it_has_the_weights_and_a_single_engine_never(backend):
    vllm = _cfg("rollout", backend=backend, engine="vllm")
    plan = make_plan(vllm, method=get_plugin("grpo"))
    assert [p.serving.takes_weights for p in plan.servers[:3]] == [True] * 3   # held until its first sync
    assert restart_budget(plan) == {0: 3, 1: 3, 2: 3}
    cpu = _cfg("rollout")                                           # dualrun's CPU engine takes no weights
    assert not make_plan(cpu, method=get_plugin("grpo")).servers[0].serving.takes_weights
    assert restart_budget(make_plan(cpu)) == {0: 3, 1: 3, 2: 3}
    teacher = _cfg()
    assert not make_plan(teacher, method=get_plugin("gkd")).servers[0].serving.takes_weights
    one = _cfg(gpus=1)
    assert restart_budget(make_plan(one)) == {}   # no router to take it back


def test_a_death_is_survived_while_restarts_are_left_and_another_replica_serves():
    plan = make_plan(_cfg())
    left = {0: 1, 1: 0, 2: 2}
    assert survivable(plan, 0, left, down=set())
    assert not survivable(plan, 1, left, down=set())          # spent
    assert not survivable(plan, 3, left, down=set())          # the router
    assert not survivable(plan, None, left, down=set())       # not one server
    assert survivable(plan, 2, left, down={0})                # replica 1 still serves
    assert not survivable(plan, 2, left, down={0, 1})         # the last one: the job ends


def test_event_lines_say_which_why_and_when_back():
    line = restarting_line("teacher server 1 exited with code -9 (killed by SIGKILL) while the job was running", 1, 3)
    assert line == ("dualrun: teacher server 1 exited with code -9 (killed by SIGKILL) while the job was running; "
                    "restarting it on the same devices (restart 1 of 3, replica_restarts)")
    assert back_line("teacher server 1", "127.0.0.1:4242", 12.34) == \
        "dualrun: teacher server 1 is back in rotation at 127.0.0.1:4242, 12.3 s after it died"
    assert back_line("teacher server 1", "127.0.0.1:4242", 12.34, 8.06) == (
        "dualrun: teacher server 1 is back in rotation at 127.0.0.1:4242, 12.3 s after it died (its engine started in "
        "8.1 s while the others served)")
    assert held_line("rollout server 1", "127.0.0.1:4242", 7.0) == (
        "dualrun: rollout server 1 is healthy again at 127.0.0.1:4242; out of rotation until it holds the trainer's "
        "weights (it joins the weight-sync group at the next sync); its engine started in 7.0 s while the others "
        "served")
    assert held_line("rollout server 1", "127.0.0.1:4242") == (
        "dualrun: rollout server 1 is healthy again at 127.0.0.1:4242; out of rotation until it holds the trainer's "
        "weights (it joins the weight-sync group at the next sync)")


@pytest.mark.parametrize("role, backend, spec, why", [
    ("teacher", "torchrun", {"gpus": 1}, "one engine has no router"),
])
def test_replica_restarts_that_would_restart_nothing_are_refused(role, backend, spec, why):
    with pytest.raises(ConfigError) as e:
        _cfg(role, backend, replica_restarts=5, **spec)
    assert e.value.key == f"roles.{role}.replica_restarts" and why in str(e.value)
    _cfg(role, backend, replica_restarts=0, **spec)   # today's behaviour: accepted everywhere


def test_teacher_replicas_are_restarted_on_ray_too():
    cfg = _cfg(backend="ray", replica_restarts=5)   # RayServers restarts them (a fresh actor and group)
    assert restart_budget(make_plan(cfg)) == {0: 5, 1: 5, 2: 5}


def test_teacher_replicas_are_restarted_on_several_torchrun_machines_too():
    cfg = _cfg(replica_restarts=5, num_machines=2, main_process_ip="10.0.0.1")   # each by its own machine
    assert restart_budget(make_plan(cfg)) == {0: 5, 1: 5, 2: 5}


def test_replica_restarts_beside_an_address_is_refused():
    with pytest.raises(ConfigError) as e:
        build_config({"method": "gkd", "roles": {"train": {"gpus": 1}, "teacher": {
            "address": "127.0.0.1:9", "top_k": 5, "replica_restarts": 2}}}, "job.yaml")
    assert e.value.key == "roles.teacher.replica_restarts"


def test_a_replica_is_hung_when_a_request_timed_out_or_its_probes_failed_for_request_timeout_s():
    timed_out = {"in_rotation": False, "kind": "timeout", "reason": "no answer within 10 s"}
    probe = {"in_rotation": False, "kind": "probe", "reason": "health probe not answered within 5 s"}
    assert hung(timed_out, 0.0, 10.0)
    assert not hung(probe, 9.0, 10.0) and hung(probe, 10.0, 10.0)      # a busy engine may miss a probe or two
    assert not hung({"in_rotation": False, "kind": "unreachable"}, 99.0, 10.0)   # dead: the process watcher's
    assert not hung({"in_rotation": True, "kind": None}, 99.0, 10.0)
    assert hung_line("teacher server 1", probe["reason"]) == ("dualrun: teacher server 1 is hung (health probe not "
                                                              "answered within 5 s); stopping it (SIGTERM, then "
                                                              "SIGKILL after 5 s)")
