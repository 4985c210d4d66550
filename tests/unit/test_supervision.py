"""Replica supervision as values, in milliseconds: the one judge of a replica's health (the router's table and the
launchers read its rows the same way), the supervision table with the clock passed in, and what the plan says of
each server (its `Serving`: command template, health, timeouts, restarts, log). The processes that follow these
rules are test_replicas.py's (a real CPU engine killed and restarted) and test_replicas_e2e.py's (a whole job)."""
from __future__ import annotations

import pytest

from dualrun.config import build_config
from dualrun.methods.plugin import get_plugin
from dualrun.plan.processes import ROUTER, Cluster, make_plan
from dualrun.plan.servers import HOST, PORT, Serving, replica_slot
from dualrun.programs import rotation
from dualrun.programs.rotation import HUNG, OUT, RESTARTING, SERVING, Rotation, judge
from dualrun.programs.routing import STATS_PATH
from dualrun.plan.server_commands import server_command, with_method
from dualrun.servers.supervision import MISSES, Supervision, liveness_path, lone, restartable


def _cfg(backend: str = "torchrun", **teacher) -> object:
    spec = {"gpus": 3, "model": "m/m", "top_k": 5, "request_timeout_s": 10, **teacher}
    cfg = build_config({"backend": backend, "method": "gkd", "use_cpu": True, "log_dir": "logs", "roles": {
        "train": {"gpus": 1}, "teacher": spec}}, "job.yaml")
    get_plugin("gkd").validate(cfg)
    return cfg


def test_the_judge_reads_a_row_of_the_routers_table_and_its_http_form_alike():
    table = Rotation(["a:1", "b:2", "c:3"])
    assert judge(table[0], 0.0, 10.0) == SERVING
    table.fail(0, rotation.TIMEOUT, "no answer within 10 s", now=1.0)
    table.probed(1, False, "health probe not answered within 5 s", now=1.0)
    table.remove(2, "died; being restarted", now=1.0)
    rows = table.rows()
    for row in (table[0], rows[0]):
        assert judge(row, 0.0, 10.0) == HUNG                  # a request got no answer: hung at once
    for row in (table[1], rows[1]):
        assert judge(row, 9.0, 10.0) == OUT and judge(row, 10.0, 10.0) == HUNG   # probes failing that long
    assert judge(rows[2], 99.0, 10.0) == RESTARTING
    table.replace(2, "c:4", now=2.0, hold=True)
    assert judge(table.rows()[2], 99.0, 10.0) == RESTARTING   # joining, held until the trainer's weights
    assert judge({"in_rotation": False, "kind": rotation.UNREACHABLE}, 99.0, 10.0) == OUT   # dead: not hung


def test_a_death_is_restarted_while_the_budget_and_another_replica_last():
    plan = make_plan(_cfg(replica_restarts=1))
    table = Supervision.of(plan)
    assert table.allowed == {0: 1, 1: 1, 2: 1} and table.supervised == [0, 1, 2]
    assert table.died(0, others_serving=True) and table.down == {0} and table.used(0) == 1
    assert table.died(1, others_serving=True)                  # replica 2 still serves
    assert not table.died(2, others_serving=True)              # the last one: the job ends
    table.back(0)
    assert not table.died(0, others_serving=True)              # its one restart is spent
    assert not table.died(2, others_serving=False)             # another machine's router says none serves
    assert not table.died(3, others_serving=True) and not table.died(None, others_serving=True)   # router, no index


def test_a_set_supervises_only_the_replicas_it_runs():
    plan = make_plan(_cfg())
    assert Supervision.of(plan, mine=[1]).allowed == {1: 3} and restartable(plan) == {0, 1, 2}
    assert Supervision.of(make_plan(_cfg(replica_restarts=0))).supervised == []


def test_a_replica_out_of_rotation_is_hung_after_request_timeout_s_on_the_clock_passed_in():
    table = Supervision.of(make_plan(_cfg()))
    probe = {"in_rotation": False, "kind": rotation.PROBE, "reason": "health probe failed"}
    assert not table.looked(1, probe, now=100.0)               # first seen out at 100
    assert not table.looked(1, probe, now=109.9)
    assert table.looked(1, probe, now=110.0) and 1 not in table.out_since   # 10 s: hung, to be stopped
    assert not table.looked(1, probe, now=111.0)               # seen out afresh
    assert not table.looked(1, {"in_rotation": True}, now=200.0) and 1 not in table.out_since
    assert not table.looked(1, probe, now=300.0)
    assert not table.looked(1, None, now=400.0) and 1 not in table.out_since   # dead or restarting: not looked at
    timed_out = {"in_rotation": False, "kind": rotation.TIMEOUT}
    table.died(0, others_serving=True)
    table.died(2, others_serving=True)
    assert not table.looked(1, timed_out, now=500.0)           # hung, but the last replica serving: routed around


FAILED = "health probe not answered within 5 s"


def test_a_router_and_an_engine_without_one_are_probed_by_their_set():
    plan = make_plan(_cfg())   # three replicas (the router judges them) and their router, which nothing else probes
    router = next(i for i, p in enumerate(plan.servers) if p.kind == ROUTER)
    assert lone(plan) == [router] and Supervision.of(plan).lone == [router]
    assert liveness_path(plan, router) == STATS_PATH   # its /health is its replicas' state (503: none in rotation)
    plan = make_plan(_cfg(gpus=1))
    assert lone(plan) == [0] and lone(plan, mine=[]) == [] and Supervision.of(plan).lone == [0]
    assert Supervision.of(plan).supervised == []                            # nothing to restart it
    assert liveness_path(plan, 0) == "/health"


def test_a_lone_server_failing_its_probes_for_request_timeout_s_is_hung_once():
    table = Supervision.of(make_plan(_cfg(gpus=1)))
    assert table.probed(0, True, "health probe answered 200", now=100.0) is None
    assert table.probed(0, False, FAILED, now=101.0) is None               # out of its rotation from 101
    assert table.probed(0, False, FAILED, now=110.9) is None
    reason = table.probed(0, False, FAILED, now=111.0)                    # 10 s: request_timeout_s
    assert reason == f"{FAILED}; its health probes failed for 10.0 s, request_timeout_s is 10"
    assert table.lone == [] and table.probed(0, False, FAILED, now=200.0) is None   # judged once: it is stopped
    assert not table.died(0, others_serving=True)                          # and its death is the job's


def test_a_slow_lone_server_that_answers_within_its_timeout_is_not_hung():
    table = Supervision.of(make_plan(_cfg(gpus=1)))
    for t in range(0, 60, 6):   # answers late, each probe passing in 5 s: never out
        assert table.probed(0, True, "health probe answered 200", now=float(t)) is None
    assert table.probed(0, False, FAILED, now=100.0) is None               # a busy spell of 9 s, then back:
    assert table.probed(0, False, FAILED, now=109.0) is None
    assert table.probed(0, True, "health probe answered 200", now=110.0) is None
    assert table.probed(0, True, "health probe answered 200", now=111.0) is None   # two passes: back in
    assert table.probed(0, False, FAILED, now=119.0) is None               # a new spell counts from its start
    assert table.probed(0, False, FAILED, now=128.0) is None
    assert table.probed(0, False, FAILED, now=129.0) is not None
    table.probing(0, 130.0)                                                # (a set's probes begin afresh)
    assert table.lone == []


def test_a_lone_servers_probes_begin_afresh_when_its_set_is_watched_again():
    table = Supervision.of(make_plan(_cfg(gpus=1)))
    assert table.probed(0, False, FAILED, now=100.0) is None
    table.probing(0, 150.0)                                                # unwatched meanwhile: forgotten
    assert table.probed(0, False, FAILED, now=200.0) is None
    assert table.probed(0, False, FAILED, now=209.9) is None and table.probed(0, False, FAILED, now=210.0)


def test_another_machines_server_is_dead_after_missing_checks_in_a_row():
    table = Supervision.of(make_plan(_cfg()))
    assert not table.checked(3, answered=False) and table.missing
    assert not table.checked(3, answered=True) and not table.missing     # answered: the count starts again
    results = [table.checked(3, answered=False) for _ in range(MISSES)]
    assert results == [False] * (MISSES - 1) + [True]


def test_the_plan_holds_each_servers_command_health_timeouts_restarts_and_log():
    cfg = _cfg(health_timeout_s=120, replica_restarts=2)
    plan = make_plan(cfg)
    first, router = plan.servers[0].serving, plan.servers[-1].serving
    assert (first.health_timeout_s, first.request_timeout_s, first.restarts, first.takes_weights) == (120, 10, 2, False)
    assert first.log_path == "logs/teacher-server-0.log" and router.log_path == "logs/teacher-router.log"
    assert router.restarts == 0 and not first.command                     # the method's commands: at launch
    with pytest.raises(ValueError, match="with_commands"):
        first.argv("127.0.0.1", 1)
    torchrun_logs = build_config({"method": "gkd", "log_dir": "a", "torchrun": {"log_dir": "b"}, "roles": {
        "train": {"gpus": 1}, "teacher": {"gpus": 2, "model": "m", "top_k": 5}}}, "j.yaml")
    assert make_plan(torchrun_logs).servers[0].serving.log_dir == "b"   # beside torchrun's own logs
    ray = _cfg("ray")
    assert make_plan(ray, Cluster.uniform(1, 0)).servers[0].serving.log_dir == "logs"
    one = make_plan(_cfg(gpus=1, replica_restarts=0)).servers
    assert len(one) == 1 and one[0].serving.restarts == 0          # one engine: no router, no restart


def test_the_plans_command_is_the_methods_with_the_runs_host_port_and_replicas_filled_in():
    cfg = _cfg()
    plugin = get_plugin("gkd")
    plan = with_method(make_plan(cfg), cfg, plugin)
    for p in plan.servers[:3]:
        assert p.serving.argv("10.0.0.2", 4242) == server_command(cfg, plugin, p, "10.0.0.2", 4242)
    router = plan.servers[-1]
    replicas = ["10.0.0.2:1", "10.0.0.3:2", "10.0.0.4:3"]
    assert router.serving.argv("0.0.0.0", 9000, replicas) == server_command(cfg, plugin, router, "0.0.0.0", 9000,
                                                                           replicas)
    assert router.serving.health_path == "/health"
    grpo = build_config({"method": "grpo", "roles": {"train": {"gpus": 1}, "rollout": {"gpus": 2, "model": "m/m"}}},
                        "j.yaml")
    rollout = get_plugin("grpo")
    rollout.validate(grpo)
    for p in with_method(make_plan(grpo), grpo, rollout).servers:   # vLLM's command, TRL's build_command's flags
        mine = replicas[:2] if p.kind == "router" else []
        assert p.serving.argv("10.0.0.2", 4242, mine) == server_command(grpo, rollout, p, "10.0.0.2", 4242, mine)
    templated = Serving(1.0, 1.0, command=("x", f"--url=http://{HOST}:{PORT}/v1", replica_slot(0)))
    assert templated.argv("h", 7, ["r:1"]) == ["x", "--url=http://h:7/v1", "r:1"]
    with pytest.raises(ValueError, match="2 replica address"):
        templated.argv("h", 7, ["r:1", "r:2"])                   # a router's replicas are the plan's, all of them


def test_a_lone_server_unanswered_for_silent_line_s_gets_one_line_and_one_when_it_answers_again():
    """With the default request_timeout_s (1800 s) a stopped lone server is judged hung only after half an hour:
    meanwhile the job would sit at its step with no line. The table says so once, SILENT_LINE_S after its last
    answer, and once when it answers again."""
    from dualrun.servers.supervision import SILENT_LINE_S

    table = Supervision.of(make_plan(_cfg(gpus=1)))
    table.probing(0, 100.0)
    assert table.heard(0, True, "health probe answered 200", 100.5) is None
    assert table.heard(0, False, FAILED, 100.5 + SILENT_LINE_S - 0.1) is None          # not yet
    line = table.heard(0, False, FAILED, 100.5 + SILENT_LINE_S + 0.5)
    assert line == (f"dualrun: teacher server 0 has not answered its health check for 6 s ({FAILED}); the job "
                    "waits on it and judges it hung after request_timeout_s (10 s)"), line
    assert table.heard(0, False, FAILED, 130.0) is None                                  # said once
    assert table.heard(0, True, "health probe answered 200", 131.0) == (
        "dualrun: teacher server 0 answers its health check again, after 30 s")
    assert table.heard(0, True, "health probe answered 200", 132.0) is None
    assert table.heard(0, False, FAILED, 134.0) is None                                  # a new spell, 2 s so far
    assert table.heard(0, False, FAILED, 137.5) is not None


def test_the_join_line_says_from_which_step_the_replica_serves_and_what_is_known_when_it_is_not():
    from dualrun.servers.supervision import joined_line, joined_summary, machine_joined_line

    assert joined_line("rollout server 1", "127.0.0.1:8002", 12, 14.24, 9.8) == (
        "dualrun: rollout server 1 joined at 127.0.0.1:8002, serving from step 12, 14.2 s after the resize asked for "
        "it (its engine started in 9.8 s while the others served)")
    assert joined_line("teacher server 1", "127.0.0.1:8002", None, 3.0, 2.0, last=7) == (
        "dualrun: teacher server 1 joined at 127.0.0.1:8002, serving from the trainer's next request (its last was "
        "of step 7), 3.0 s after the resize asked for it (its engine started in 2.0 s while the others served)")
    assert "serving from the trainer's next request, 3.0 s" in joined_line("t", "a:1", None, 3.0, 2.0)
    assert machine_joined_line("teacher server 1", "10.0.0.8:9000", 1, 3, 1.23, 2, 2) == (
        "dualrun: teacher server 1 joined at 10.0.0.8:9000 with machine 1, serving from step 3, 1.2 s after "
        "machine 1 offered it; 2 of max 2 replicas run")
    assert joined_summary("teacher server 1", 3, 6.2, "after the resize asked for it") == \
        "teacher server 1 joined 6.2 s after the resize asked for it, serving from step 3"
    assert joined_summary("teacher server 1", None, 6.2, "after the resize asked for it").endswith(
        ", its step unknown (no request of the trainer's that carried one reached it)")
