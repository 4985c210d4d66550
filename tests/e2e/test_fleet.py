"""A separate role's fleet between `min_replicas` and `max_replicas`: the bounds refused where they mean nothing, the
plan's spare replicas, the router's spare slots, the supervision table's choices (pure, milliseconds), and a real
set of CPU engines resized while watched (`LocalServers.scale`, slow). The job-level runs (`dualrun scale` against a
training job) are in test_fleet_e2e.py.
"""
from __future__ import annotations

import re

import pytest

from dualrun.config import build_config
from dualrun.contract.errors import ConfigError, ScaleRefused
from dualrun.methods.plugin import get_plugin
from dualrun.plan.processes import ROUTER, make_plan
from dualrun.plan.server_commands import with_method
from dualrun.programs.rotation import JOINING, LAUNCHER, SPARE, Rotation
from dualrun.servers.planned import at_launch, replica_addresses
from dualrun.servers.supervision import Supervision


def _cfg(teacher: dict, backend: str = "torchrun", **top) -> object:
    cfg = build_config({"backend": backend, "method": "gkd", "use_cpu": True, **top,
                        "roles": {"train": {"gpus": 2}, "teacher": {"model": "m/m", "top_k": 5, **teacher}}},
                       "job.yaml")
    get_plugin("gkd").validate(cfg)
    return cfg


# -- the bounds ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("teacher,key,expected", [
    ({"gpus": 2, "min_replicas": 3, "max_replicas": 4}, "roles.teacher.min_replicas", "at most the planned count"),
    ({"gpus": 2, "min_replicas": 2, "max_replicas": 1}, "roles.teacher.min_replicas", "at most max_replicas (1)"),
    ({"gpus": 2, "max_replicas": 1}, "roles.teacher.max_replicas", "at least the planned count"),
    ({"gpus": 1, "max_replicas": 2, "gpu_ids": [0]}, "roles.teacher.", ""),   # refused by gpu_ids on CPU first
])
def test_bounds_that_cannot_hold_are_one_line_naming_the_key(teacher, key, expected):
    with pytest.raises(ConfigError) as e:
        _cfg(teacher)
    assert e.value.key.startswith(key) and expected in e.value.expected, e.value.line()


def test_bounds_are_refused_where_no_fleet_grows():
    for where, spec in [("the trainer role", {"train": {"gpus": 2, "max_replicas": 3}, "teacher": {"gpus": 1}}),
                        ("colocated", {"train": {"gpus": 2}, "teacher": {"gpus": 2, "min_replicas": 1}})]:
        groups = [["train", "teacher"]] if where == "colocated" else []
        spec = {k: {"model": "m/m", "top_k": 5, **v} if k == "teacher" else v for k, v in spec.items()}
        with pytest.raises(ConfigError) as e:
            get_plugin("gkd").validate(build_config({"method": "gkd", "use_cpu": True, "roles": spec,
                                                     "colocate_groups": groups}, "job.yaml"))
        assert "replicas" in e.value.key and "no " in e.value.expected, e.value.line()
    with pytest.raises(ConfigError) as e:
        _cfg({"address": "127.0.0.1:9", "max_replicas": 2, "gpus": 0})
    assert e.value.key == "roles.teacher.max_replicas" and "beside `address`" in e.value.expected
    with pytest.raises(ConfigError) as e:   # several torchrun machines: a spare where ranks run has no way to start
        make_plan(_cfg({"gpus": 1, "max_replicas": 2}, "torchrun", num_machines=2, main_process_ip="10.0.0.1",
                       torchrun={"gpus_per_machine": 4}))
    assert e.value.key == "roles.teacher.max_replicas" and "optional serving machines" in e.value.expected
    assert "teacher server 1 is on machine 0, where ranks run" in e.value.line(), e.value.line()


def test_on_several_torchrun_machines_the_replicas_above_min_come_with_an_optional_serving_machine():
    """Trainers on machine 0 beside replica 0 and the router; replica 1 alone on machine 1, which runs no ranks: an
    optional machine. Machine 0's router keeps its slot empty and its table parks it; machine 1 starts it."""
    from dualrun.plan.optional import joining, optional_machines
    from dualrun.servers.planned import awaited

    top = {"num_machines": 2, "main_process_ip": "10.0.0.1", "torchrun": {"gpus_per_machine": 3}}
    spec = {"gpus": 1, "max_replicas": 2}
    cfg = build_config({"backend": "torchrun", "method": "gkd", "use_cpu": True, **top, "roles": {
        "train": {"gpus": 2, "machines": [0]}, "teacher": {"model": "m/m", "top_k": 5, **spec}}}, "job.yaml")
    plan = make_plan(cfg)
    assert optional_machines(plan) == {1: (1,)} and joining(plan) == {1}
    assert [p.node for p in plan.servers] == [0, 1, 0]
    assert 1 in at_launch(plan)[0] and not awaited(plan, 1) and awaited(plan, 0)
    assert replica_addresses(plan, {0: "a:1"}, 2) == ["a:1", SPARE]
    assert Supervision.of(plan, [0, 2]).parked == {1}   # machine 0: parked until machine 1 comes
    assert Supervision.of(plan, [1]).parked == set()    # machine 1: it runs it
    assert "optional: the job starts without it" in plan.table() and "optional machines come and go" in plan.table()
    with pytest.raises(ScaleRefused, match="follows its optional machines"):
        from dualrun.servers.supervisor import Supervisor
        Supervisor(plan, None, None, lambda i: None, [0, 2]).scale("teacher", 2)   # type: ignore[arg-type]
    with pytest.raises(ConfigError) as e:   # a replica below min there too: that machine is needed, not optional
        make_plan(build_config({"backend": "torchrun", "method": "gkd", "use_cpu": True, **top, "roles": {
            "train": {"gpus": 3, "machines": [0]}, "teacher": {"model": "m/m", "top_k": 5, "gpus": 2,
                                                              "min_replicas": 1}}}, "job.yaml"))
    assert "where a replica the job needs runs too" in e.value.line(), e.value.line()
    with pytest.raises(ConfigError) as e:   # SLURM: no fleets yet
        _cfg({"gpus": 1, "max_replicas": 2}, "slurm")
    assert "on backend slurm" in e.value.line(), e.value.line()


def test_ray_runs_fleets():
    """Ray's server set starts and stops spares (backends/ray/fleet_follow.py): its bounds are accepted."""
    plan = make_plan(_cfg({"gpus": 1, "min_replicas": 1, "max_replicas": 3}, "ray"))
    assert plan.fleets["teacher"].resizable and [p.serving.spare for p in plan.servers[:3]] == [False, True, True]


def test_bounds_equal_to_the_planned_count_are_accepted_everywhere():
    """Redundant but consistent: nothing to refuse (a file written for the planned count reads the same)."""
    for backend in ("torchrun", "ray"):
        cfg = _cfg({"gpus": 2, "min_replicas": 2, "max_replicas": 2}, backend)
        plan = make_plan(cfg)
        assert [p.label for p in plan.servers] == ["teacher server 0", "teacher server 1", "teacher router"]
        assert not any(p.serving.spare for p in plan.servers) and not plan.fleets["teacher"].resizable


# -- the plan --------------------------------------------------------------------------------------------------
def test_spares_are_planned_with_a_router_in_front_even_of_one():
    cfg = _cfg({"gpus": 1, "max_replicas": 3})
    plan = with_method(make_plan(cfg), cfg, get_plugin("gkd"))
    assert [(p.label, p.serving.spare) for p in plan.servers] == [
        ("teacher server 0", False), ("teacher server 1", True), ("teacher server 2", True),
        ("teacher router", False)]
    assert at_launch(plan) == [[0], [3]]   # the spares wait for a resize
    assert replica_addresses(plan, {0: "127.0.0.1:9001"}, 3) == ["127.0.0.1:9001", SPARE, SPARE]
    table = plan.table()
    assert "teacher server 1  (spare: started by `dualrun scale`)" in table
    assert "fleet teacher: 1 started, min 1, max 3 replicas (`dualrun scale teacher N` while it runs)" in table
    assert plan.to_dict()["fleets"] == {"teacher": {"start": 1, "min": 1, "max": 3}}


def test_spares_need_room_like_the_replicas_started_at_launch():
    with pytest.raises(ConfigError) as e:
        make_plan(_cfg({"gpus": 1, "max_replicas": 3}, torchrun={"gpus_per_machine": 3}))
    assert e.value.key == "roles.teacher.max_replicas" and "spare replica 1" in e.value.expected, e.value.line()


def test_on_ray_a_spare_with_no_room_is_planned_unplaced_for_the_cluster_to_place_later():
    """Ray's nodes come while the job runs (the policy's `spares_unplaced`): a GPU spare that finds no free GPU when
    the plan is made waits for a node with room (backends/ray/fleet_follow.py) instead of being refused. The trainers
    and the replicas started at launch still need room; torchrun's machines are fixed: refused as before."""
    from dualrun.backends.ray.bundles import bundle_of, demand
    from dualrun.plan.placement import UNPLACED, Cluster, Node, placement_for
    from dualrun.servers.planned import started_when
    from dualrun.weightsync.sync_group import sync_group

    def cfg(backend: str, train: int = 1, **top: object) -> object:
        c = build_config({"backend": backend, "method": "gkd", **top, "roles": {"train": {"gpus": train}, "teacher": {
            "gpus": 1, "min_replicas": 1, "max_replicas": 3, "model": "m/m", "top_k": 5}}}, "job.yaml")
        get_plugin("gkd").validate(c)
        return c

    def node(gpus: int) -> Cluster:
        return Cluster((Node(0, "10.0.0.7", gpus, 8.0),), "ray")

    ray = cfg("ray")
    assert placement_for(ray).spares_unplaced and not placement_for(cfg("torchrun")).spares_unplaced
    plan = with_method(make_plan(ray, node(3)), ray, get_plugin("gkd"))   # rank 0, replica 0, spare 1: spare 2 waits
    assert [(p.label, p.node, p.devices, p.serving.spare) for p in plan.servers] == [
        ("teacher server 0", 0, (1,), False), ("teacher server 1", 0, (2,), True),
        ("teacher server 2", UNPLACED, (), True), ("teacher router", 0, (), False)]
    waiting = plan.servers[2]
    assert not waiting.placed and waiting.gpus == 1 and waiting.env["CUDA_VISIBLE_DEVICES"] == "<auto>"
    assert bundle_of(ray.ray, waiting) == {"GPU": 1.0}   # the shape of its pending placement group
    assert demand(ray.ray, plan)["GPU"] == 2.0 and demand(ray.ray, plan, spares=True)["GPU"] == 4.0
    assert at_launch(plan) == [[0], [3]] and replica_addresses(plan, {0: "a:1"}, 3) == ["a:1", SPARE, SPARE]
    assert ("unplaced: no node above has room for these\n"
            "  1 GPU(s)     teacher server 2  (a spare, placed when a node with room joins)\n"
            "fleet teacher: 1 started, min 1, max 3 replicas") in plan.table(), plan.table()
    assert [p["node"] for p in plan.to_dict()["processes"]] == [0, 0, 0, None, 0]
    assert started_when(plan, "teacher server 2") == "a spare, placed when a node with room joins (not at launch)"
    assert started_when(plan, "teacher server 1") == ("a spare, started when the cluster has room for it, or by "
                                                      "`dualrun scale` (not at launch)")   # Ray's fleet follows room
    assert "teacher server 1  (spare: started when the cluster has room for it, or by `dualrun scale`)" in \
        plan.table(), plan.table()
    assert sync_group(ray, plan) is None   # a teacher takes no weights; an unplaced rollout spare has no node to check
    one = make_plan(ray, node(2))   # the only free GPU runs replica 0: both spares wait
    assert [p.placed for p in one.servers] == [True, False, False, True]
    for cluster, key in ((node(1), "roles.teacher.gpus"), (Cluster((), "ray"), "roles.train.gpus")):
        with pytest.raises(ConfigError) as e:   # replica 0 (started at launch), or the trainers, without room
            make_plan(ray, cluster)
        assert e.value.key == key, e.value.line()
    with pytest.raises(ConfigError) as e:
        make_plan(cfg("torchrun", torchrun={"gpus_per_machine": 3}))
    assert e.value.line() == ("job.yaml: roles.teacher.max_replicas: expected room for each replica up to it: 1 free "
                              "GPUs on one node for each (spare replica 2 finds at most 0), got 3"), e.value.line()


def test_a_placement_policy_without_spares_unplaced_keeps_its_machines_fixed(monkeypatch):
    """A backend's policy written before `spares_unplaced` came (docs/plugins.md): its spares need room when the plan
    is made, as on torchrun: one line for a spare without room, not an AttributeError."""
    import dualrun.plan.processes as processes
    from dualrun.plan.placement import Cluster, Node, placement_for, spares_unplaced

    class Older:
        """Ray's policy less the member."""

        def __init__(self, policy: object) -> None:
            self._policy = policy

        def __getattr__(self, name: str) -> object:
            if name == "spares_unplaced":
                raise AttributeError(name)
            return getattr(self._policy, name)

    cfg = build_config({"backend": "ray", "method": "gkd", "roles": {"train": {"gpus": 1}, "teacher": {
        "gpus": 1, "min_replicas": 1, "max_replicas": 2, "model": "m/m", "top_k": 5}}}, "job.yaml")
    assert spares_unplaced(placement_for(cfg)) and not spares_unplaced(Older(placement_for(cfg)))
    monkeypatch.setattr(processes, "placement_for", lambda c: Older(placement_for(c)))
    roomy = make_plan(cfg, Cluster((Node(0, "10.0.0.7", 3, 8.0),), "ray"))   # room for the spare: placed, as before
    assert [p.placed for p in roomy.servers] == [True, True, True] and not roomy.spares_follow_room
    with pytest.raises(ConfigError) as e:
        make_plan(cfg, Cluster((Node(0, "10.0.0.7", 2, 8.0),), "ray"))
    assert e.value.line() == ("job.yaml: roles.teacher.max_replicas: expected room for each replica up to it: 1 free "
                              "GPUs on one node for each (spare replica 1 finds at most 0), got 2"), e.value.line()


def test_replica_restarts_take_effect_once_a_router_stands_in_front_of_one():
    _cfg({"gpus": 1, "max_replicas": 2, "replica_restarts": 1})   # accepted: the router takes a restarted one back
    with pytest.raises(ConfigError):
        _cfg({"gpus": 1, "replica_restarts": 1})


# -- the router's table ----------------------------------------------------------------------------------------
def test_a_spare_slot_is_out_and_no_member_until_an_engine_fills_it_and_retire_empties_it():
    table = Rotation(["127.0.0.1:1", SPARE])
    assert table.in_rotation() == [0] and table.members() == [0] and table[1].spare
    with pytest.raises(ValueError, match="spare slot"):
        table.restore(1, 0.0)
    event = table.replace(1, "127.0.0.1:2", 1.0, hold=True)
    assert "replica 1 joining at 127.0.0.1:2" in event.line and table[1].kind == JOINING
    assert table.members() == [0, 1] and table.membership == 1
    for now in (2.0, 3.0):
        table.probed(1, True, "ok", now)
    assert table.in_rotation() == [0]   # held: no request before the trainer's weights
    table.weights_received(1)
    assert table.weights_finished(1, 4.0) is not None and table.in_rotation() == [0, 1]
    event = table.retire(1, "scaled down", 5.0)
    assert event.line == "replica 1 (127.0.0.1:2) left: scaled down; 1 of 1 in rotation" and not event.abort
    assert table[1].spare and table[1].kind == LAUNCHER and table.members() == [0] and table.membership == 2


def test_a_grow_the_jobs_end_cuts_short_is_the_resizes_failure_not_a_success():
    """The set stopped while the spare was starting (`_bring_in` answers None): `dualrun scale` gets a failure that
    says so (ScaleCutShort: exit 1), not "2 replicas now" with no replica joined."""
    from dualrun.contract.errors import ScaleCutShort
    from dualrun.servers.supervisor import Supervisor

    class Ending:   # the job's server set (supervisor.Events): running when asked, then ending
        watching = True

        def wait_stopped(self, timeout: float | None = None) -> bool:
            return True

    class Stopped:   # LocalServers' respawn once the set is stopping: no process, None
        def respawn(self, index: int, restart: int) -> None:
            events.watching = False
            return None

    events = Ending()
    supervisor = Supervisor(make_plan(_cfg({"gpus": 1, "max_replicas": 3})), events, Stopped(),  # type: ignore
                            lambda i: "127.0.0.1:1")
    with pytest.raises(ScaleCutShort) as e:
        supervisor.scale("teacher", 2)
    assert e.value.exit_code == 1 and str(e.value) == ("teacher: the job ended during the resize, before teacher "
                                                       "server 1 joined (the launch's output says why)")
    assert supervisor.history == []


def test_a_grow_whose_replica_waits_for_rotation_when_the_ranks_end_is_cut_short_too(tmp_path):
    """The ranks end while the new replica waits to enter its router's rotation (a rollout's waits for the next
    sync): it never served, so it is not "joined" and the resize is no success. A real router process in front of a
    recording stub; the new engine a stub whose health fails (it never enters rotation)."""
    import sys
    import threading

    from dualrun.contract.errors import ScaleCutShort
    from dualrun.plan.server_commands import router_argv
    from dualrun.servers.supervisor import Supervisor
    from helpers import ASSETS, free_port
    from test_router import _server, _start_all

    rec = tmp_path / "rec"
    rec.mkdir()
    stubs = [_server(name, [sys.executable, str(ASSETS / "recording_replica.py"), str(free_port()), "1", str(rec),
                            name], tmp_path / f"{name}.log") for name in ("r0", "r1")]
    _start_all(stubs)
    (rec / "r1.sick").touch()   # its /health answers 503 from now on
    router = _server("router", router_argv("127.0.0.1", free_port(), [stubs[0].address, SPARE]),
                     tmp_path / "router.log")
    _start_all([router])

    class Ending:   # the job's server set: its ranks end a second into the resize (the set not yet stopped)
        watching = True

        def wait_stopped(self, timeout: float | None = None) -> bool:
            return True

    class Started:   # the backend's primitives: the spare's engine started at r1's address, alive
        def respawn(self, index: int, restart: int) -> str:
            threading.Timer(1.0, lambda: setattr(events, "watching", False)).start()
            return stubs[1].address

        def alive(self, index: int) -> bool:
            return True

        def rearm(self, index: int, address: str) -> bool:
            return True

    events = Ending()
    cfg = _cfg({"gpus": 1, "max_replicas": 2, "health_timeout_s": 60})
    plan = make_plan(cfg)
    at = {i: router.address for i, p in enumerate(plan.servers) if p.kind == ROUTER}
    supervisor = Supervisor(plan, events, Started(), lambda i: at.get(i))  # type: ignore[arg-type]
    try:
        with pytest.raises(ScaleCutShort, match="the job ended during the resize, before teacher server 1 joined"):
            supervisor.scale("teacher", 2)
        assert supervisor.history == []
    finally:
        for server in (router, *stubs):
            server.stop(grace_s=2)


def test_a_router_needs_one_engine_at_least():
    with pytest.raises(ValueError):
        Rotation([SPARE, SPARE])


# -- the supervision table -------------------------------------------------------------------------------------
def test_resizes_start_the_lowest_spares_and_stop_the_highest_running():
    cfg = _cfg({"gpus": 2, "min_replicas": 1, "max_replicas": 4})
    table = Supervision.of(make_plan(cfg))
    assert table.parked == {2, 3} and table.running("teacher") == [0, 1]
    assert table.to_start("teacher", 1) == [2] and table.down == {2}
    table.back(2)
    assert table.running("teacher") == [0, 1, 2]
    assert table.to_stop("teacher", 2) == [2, 1] and table.running("teacher") == [0]


def test_a_dead_replica_without_restarts_leaves_while_min_replicas_remain():
    cfg = _cfg({"gpus": 3, "min_replicas": 2, "replica_restarts": 0})
    table = Supervision.of(make_plan(cfg))
    assert not table.died(0, True)           # no restarts: not restarted ...
    assert table.leaves(0, True)             # ... but 2 of min 2 remain: it leaves
    assert table.running("teacher") == [1, 2]
    assert not table.died(1, True) and not table.leaves(1, True)   # 1 would remain: the job's
    default = Supervision.of(make_plan(_cfg({"gpus": 2, "replica_restarts": 0})))
    assert not default.leaves(0, True)       # min defaults to the planned count: as before


# -- a real set, resized ---------------------------------------------------------------------------------------
def _complete(router: str, prompts: list[str], step: int) -> dict:
    """A trainer's completion request through the router, carrying its step as the ranks' hook adds it."""
    import json
    import urllib.request

    from dualrun.contract import protocol
    from dualrun.contract.job_token import auth_headers, job_token

    request = urllib.request.Request(
        f"http://{router}/v1/completions", method="POST",
        data=json.dumps({"prompt": prompts, "max_tokens": 2, "temperature": 0.0}).encode(),
        headers={"Content-Type": "application/json", protocol.STEP_HEADER: str(step), **auth_headers(job_token())})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=120) as answer:
        return json.loads(answer.read())


@pytest.mark.e2e
@pytest.mark.slow   # up to two CPU engines and a router: ~10 CPU-s
def test_local_servers_grow_onto_a_spare_and_shrink_back_while_watched(tmp_path, tiny, capfd):
    import os
    import time

    from dualrun.servers import router_client
    from dualrun.servers.local import LocalServers
    from dualrun.servers.process import http_ok
    from helpers import eventually

    cfg = _cfg({"gpus": 1, "max_replicas": 2, "model": str(tiny / "teacher"), "health_timeout_s": 120},
               log_dir=str(tmp_path))
    servers = LocalServers(with_method(make_plan(cfg), cfg, get_plugin("gkd")), lambda p: dict(os.environ, **p.env),
                           stream=None)
    with servers:
        address = servers.start()["teacher"]
        assert sorted(servers.running) == [0, 2] and router_client.replicas(address)["in_rotation"] == [0]
        with pytest.raises(ScaleRefused, match="not running"):
            servers.scale("teacher", 2)   # not watched yet: the job is not running
        servers.watch()
        assert servers.fleets() == {"teacher": {"replicas": 1, "min": 1, "max": 2}}
        for n, why in [(3, "out of its bounds"), (0, "out of its bounds")]:
            with pytest.raises(ScaleRefused, match=why):
                servers.scale("teacher", n)
        with pytest.raises(ScaleRefused, match="no resizable fleet 'rollout'"):
            servers.scale("rollout", 2)
        line = servers.scale("teacher", 2)
        assert re.fullmatch(r"dualrun: teacher: 2 replicas now \(1 joined in [\d.]+ s\)", line), line
        err = capfd.readouterr().err
        assert re.search(rf"dualrun: teacher server 1 joined at {re.escape(servers.running[1].address)}, serving "
                         r"from the trainer's next request, [\d.]+ s after the resize asked for it \(its engine "
                         r"started in [\d.]+ s", err), err   # no trainer asked anything yet: no step known
        assert router_client.replicas(address)["in_rotation"] == [0, 1] and http_ok(f"http://{address}/health")
        assert servers.fleets()["teacher"]["replicas"] == 2
        time.sleep(3)   # it outlives the resize (a local engine dies with the thread that spawned it)
        assert servers.running[1].alive() and router_client.replicas(address)["in_rotation"] == [0, 1]
        assert "restarting it" not in capfd.readouterr().err
        # a trainer's request at its step 5 (the header its ranks add), two prompts: one on each replica; the
        # summary's entry of the join says the step of the first request the grown replica answered
        _complete(address, ["a b", "c d"], step=5)
        assert router_client.replicas(address)["replicas"][1]["from_step"] == 5
        assert eventually(lambda: "serving from step 5" in servers.fleet_history[0], timeout=10), servers.fleet_history
        assert "already" in servers.scale("teacher", 2)
        grown = servers.running[1]
        line = servers.scale("teacher", 1)
        assert line == "dualrun: teacher: 1 replicas now (1 left)", line
        assert "dualrun: teacher server 1 left (scaled down); 1 of min 1 remain" in capfd.readouterr().err
        table = router_client.replicas(address)
        assert table["in_rotation"] == [0] and table["replicas"][1]["address"] == SPARE
        assert not grown.alive() and servers.failure is None and servers.next_death(timeout=1.5) is None
        history = servers.fleet_history
        assert len(history) == 2 and history[1] == "teacher server 1 left (scaled down)", history
        assert re.fullmatch(r"teacher server 1 joined [\d.]+ s after the resize asked for it \(its engine started in "
                            r"[\d.]+ s\), serving from step 5", history[0]), history
    assert not servers.running


@pytest.mark.e2e
@pytest.mark.slow
def test_a_replica_that_dies_with_no_restart_leaves_while_min_replicas_remain(tmp_path, tiny, capfd):
    import os
    import signal

    from dualrun.servers import router_client
    from dualrun.servers.local import LocalServers
    from helpers import eventually

    cfg = _cfg({"gpus": 2, "min_replicas": 1, "replica_restarts": 0, "model": str(tiny / "teacher"),
                "health_timeout_s": 120}, log_dir=str(tmp_path))
    servers = LocalServers(with_method(make_plan(cfg), cfg, get_plugin("gkd")), lambda p: dict(os.environ, **p.env),
                           stream=None)
    with servers:
        address = servers.start()["teacher"]
        servers.watch()
        os.kill(servers.running[1].proc.pid, signal.SIGKILL)
        err: list[str] = []
        assert eventually(lambda: err.append(capfd.readouterr().err) or "teacher server 1 left" in "".join(err),
                          timeout=30), "".join(err)
        assert re.search(r"dualrun: teacher server 1 left \(died: teacher server 1 exited with code -9 .*\); 1 of "
                         r"min 1 remain", "".join(err)), "".join(err)
        assert servers.failure is None and router_client.replicas(address)["in_rotation"] == [0]
        assert servers.fleets() == {"teacher": {"replicas": 1, "min": 1, "max": 2}}
        os.kill(servers.running[0].proc.pid, signal.SIGKILL)   # the last one: the job's
        death = servers.next_death(timeout=10)
        assert death is not None and death.index == 0 and servers.failure is death
    assert not servers.running


def test_the_plan_says_whether_the_trainers_push_their_weights():
    """Plan.weight_sync (a weight-sync port for the trainers) from the method's weight roles, not from which
    address variable the wiring holds."""
    def plan(rollout: dict):
        cfg = build_config({"method": "grpo", "use_cpu": True, "roles": {"train": {"gpus": 2}, "rollout": rollout}},
                           "job.yaml")
        return make_plan(cfg, method=get_plugin("grpo"))
    assert plan({"gpus": 1, "engine": "vllm", "model": "m/m"}).weight_roles == {"rollout"}
    assert plan({"address": "127.0.0.1:8000"}).weight_sync            # a user-run vLLM: TRL's client syncs it
    gkd = build_config({"method": "gkd", "use_cpu": True, "roles": {"train": {"gpus": 2}, "teacher": {
        "gpus": 1, "model": "m/m", "top_k": 5}}}, "job.yaml")
    assert not make_plan(gkd, method=get_plugin("gkd")).weight_sync   # a teacher takes no weights
    assert not make_plan(build_config({"method": "grpo", "use_cpu": True, "roles": {"train": {"gpus": 2}}},
                                      "job.yaml"), method=get_plugin("grpo")).weight_sync   # no separate rollout


def test_the_dry_run_says_a_spare_is_started_by_a_resize_and_the_router_has_its_slot(tmp_path):
    from helpers import dualrun

    (tmp_path / "c.yaml").write_text("use_cpu: true\nmethod: gkd\nroles:\n  train: {gpus: 2}\n"
                                     "  teacher: {gpus: 1, max_replicas: 2, model: m/m, top_k: 5}\n")
    (tmp_path / "w.py").write_text("")
    r = dualrun("launch", "--config_file", "c.yaml", "--dry_run", "w.py", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert any(ln.startswith("# teacher server 0, started beside the trainers: ") for ln in lines), r.stdout
    assert any(ln.startswith("# teacher server 1, a spare, started by `dualrun scale` (not at launch): ")
               for ln in lines), r.stdout
    router = next(ln for ln in lines if ln.startswith("# teacher router, started beside the trainers: "))
    assert "--replica '<auto>' --replica -" in router or "--replica <auto> --replica -" in router, router
