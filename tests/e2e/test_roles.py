"""The role API: dispatch/collect rules (pure), local groups, and the same calls on a real Ray cluster with
fake GPUs (each group on its own GPUs), compared result for result; slice dispatch measured at ~1/N bytes."""
from __future__ import annotations

import os
import sys
import tempfile

import pytest

import dualrun
from dualrun.role_programs import dispatch as D
from dualrun.role_programs.runtime import Runtime
from dualrun.role_programs.spec import RolesSpec, load_spec

ROLES = {"roles": {"a": {"gpus": 2}, "b": {"gpus": 3}, "c": {"gpus": 1}, "d": {"gpus": 1}},
         "colocate_groups": [["c", "d"]]}


@dualrun.worker(group=["a", "b"])
class Calc:
    def __init__(self, k: int) -> None:
        ctx = dualrun.current()
        self.k, self.rank, self.size = k, ctx.rank, ctx.world_size

    def apply(self, xs, scale=1):
        return [x * self.k * scale + self.rank for x in xs]

    @dualrun.function(group="a", dispatch="slice", collect="flatten")
    def times(self, xs):
        return [x * self.k for x in xs]

    @dualrun.function(group="b", execute="first")
    def head(self):
        return self.rank

    @dualrun.function(group="b")
    def fail_on(self, rank):
        if self.rank == rank:
            raise ValueError(f"bad input on rank {self.rank}")
        return self.rank

    @dualrun.function(group="b")
    def where(self):
        return os.environ.get("CUDA_VISIBLE_DEVICES")


@dualrun.worker(group=["c", "d"])
class Where:
    @dualrun.function(group="c")
    def c(self):
        return os.environ.get("CUDA_VISIBLE_DEVICES")

    @dualrun.function(group="d")
    def d(self):
        return os.environ.get("CUDA_VISIBLE_DEVICES")


class Broken:
    def __init__(self) -> None:
        raise RuntimeError("cannot build")


class Sink:
    def take(self, batch):
        return len(batch)


def pairs(n, i, xs, scale=1):  # a custom dispatch: worker i gets every n-th item
    return (xs[i::n],), {"scale": scale}


DISPATCHES = ["all", "slice", pairs]
EXECUTES = ["all", "first"]
COLLECTS = ["none", "flatten", lambda rs: sorted(x for r in rs for x in r)]


# -- pure logic -----------------------------------------------------------------------------------------
def test_bounds_cover_contiguously_and_balance():
    for length in range(0, 12):
        for n in range(1, 6):
            spans = [D.bounds(length, n, i) for i in range(n)]
            assert spans[0][0] == 0 and spans[-1][1] == length
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            sizes = [b - a for a, b in spans]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_slice_shorter_than_workers_gives_trailing_empty_shares():
    shares = [D.dispatch_slice(4, i, [1, 2], "keep", n=5)[0] for i in range(4)]
    assert [s[0] for s in shares] == [[1], [2], [], []]
    assert all(s[1] == "keep" for s in shares)


def test_slice_cuts_arrays_and_tuples_not_strings_or_dicts():
    import numpy as np

    a, k = D.dispatch_slice(2, 1, np.arange(5), (1, 2, 3), "abcd", {"x": [1, 2]})
    assert a[0].tolist() == [3, 4] and a[1] == (3,) and a[2] == "abcd" and a[3] == {"x": [1, 2]}


def test_execute_first_ignores_dispatch():
    assert D.plan_calls(3, "first", "slice", ([1, 2, 3],), {}) == [(0, ([1, 2, 3],), {})]


def test_flatten_lists_tuples_dicts():
    assert D.collect_flatten([[1], [2, 3], []]) == [1, 2, 3]
    assert D.collect_flatten([([1], ["a"]), ([2], ["b"])]) == ([1, 2], ["a", "b"])
    assert D.collect_flatten([{"x": [1]}, {"x": [2]}]) == {"x": [1, 2]}
    assert D.collect_flatten([None, None]) == []


def test_registry_is_open_and_unknown_rules_fail_early():
    D.register_collect("sum")(lambda rs: sum(rs))
    assert D.resolve_collect("sum")([1, 2]) == 3
    with pytest.raises(ValueError, match="dispatch='nope'"):
        dualrun.function(dispatch="nope")
    with pytest.raises(ValueError, match="execute="):
        dualrun.function(execute="some")


def test_decorator_checks_groups():
    with pytest.raises(ValueError, match="needs group"):
        @dualrun.worker(group=["a", "b"])
        class Two:
            @dualrun.function()
            def f(self):
                return 1
    with pytest.raises(ValueError, match="not one of the class's groups"):
        @dualrun.worker(group="a")
        class Other:
            @dualrun.function(group="z")
            def f(self):
                return 1


def test_unknown_group_is_a_clear_error():
    rt = Runtime(load_spec(ROLES), "local")
    with pytest.raises(dualrun.UnknownGroupError, match="group 'zz' is not a role of the config"):
        dualrun.WorkerGroup(Sink, "zz", runtime=rt)


def test_torchrun_groups_get_their_planned_gpus():
    from dualrun.config.load import build_config
    from dualrun.role_programs.child_workers import worker_devices

    swift = {"method": "sampling", "device_groups": {
        "nproc_per_node": 4, "s": {"device": "GPU", "ranks": "list(range(0, 2))", "workers": ["sampler"]},
        "r": {"device": "GPU", "ranks": [2, 3], "workers": ["prm", "orm"]}}}
    spec = load_spec(build_config({**swift, "backend": "torchrun"}, "x.yaml"))
    assert [(g.name, g.devices) for g in spec.groups] == [("sampler", (0, 1)), ("prm", (2, 3)), ("orm", (2, 3))]
    assert RolesSpec.from_json(spec.to_json()) == spec
    assert all(not g.devices for g in load_spec(build_config({**swift, "backend": "ray"}, "x.yaml")).groups)
    assert [worker_devices((2, 3), 2, r) for r in (0, 1)] == [(2,), (3,)]
    assert [worker_devices((4, 5, 6, 7), 2, r) for r in (0, 1)] == [(4, 5), (6, 7)]
    assert [worker_devices((4,), 3, r) for r in (0, 1, 2)] == [(4,), (4,), (4,)]


def test_spec_survives_env_round_trip():
    spec = load_spec(ROLES)
    assert RolesSpec.from_json(spec.to_json()) == spec
    assert spec.group("c").unit == ("c", "d") and spec.group("b").size == 3


def test_role_program_detection(tmp_path):
    from dualrun.role_programs.driver import is_role_program

    yes = tmp_path / "a.py"
    yes.write_text("import dualrun\n@dualrun.worker(group='x')\nclass A: pass\n")
    no = tmp_path / "b.py"
    no.write_text("from trl import SFTTrainer\nprint('train')\n")
    assert is_role_program(str(yes)) and not is_role_program(str(no))


@pytest.mark.e2e     # groups of more than one worker start processes
@pytest.mark.timeout(120)
def test_local_proxy_and_errors():
    dualrun.init(ROLES, backend="local")
    try:
        calc = Calc(3)
        assert calc.times(list(range(5))) == [0, 3, 6, 9, 12]
        assert calc.head() == [0]
        with pytest.raises(dualrun.WorkerError) as err:
            calc.fail_on(2)
        assert err.value.rank == 2 and "bad input on rank 2" in err.value.remote_traceback
        with pytest.raises(AttributeError, match="only its @dualrun.function methods"):
            calc.apply
        with pytest.raises(dualrun.WorkerError, match="cannot build"):
            dualrun.WorkerGroup(Broken, "a")
    finally:
        dualrun.shutdown()


# -- Ray (fake GPUs) vs local ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def local_ray():
    import ray
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import the tests folder
    tmp = tempfile.mkdtemp(prefix="drr", dir="/tmp")
    if ray.is_initialized():   # connected to the run's shared cluster (conftest.ray_cluster): this module starts its own
        ray.shutdown()
    ray.init(address="local", num_gpus=8, num_cpus=8, include_dashboard=False, _temp_dir=tmp,
             log_to_driver=False)
    runtime = dualrun.init(ROLES, backend="ray", track_bytes=True)
    yield runtime
    dualrun.shutdown()
    ray.shutdown()


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_a_group_the_cluster_cannot_place_fails_with_one_line(local_ray):
    """16 GPUs asked of an 8-GPU cluster: after placement_timeout_s, one line naming the roles (exit code 2)."""
    import ray

    from dualrun.contract.errors import LaunchError
    from dualrun.backends.ray.cluster import Gang
    from dualrun.backends.ray.actor_groups import make_placement
    from dualrun.role_programs.spec import GroupSpec

    from dualrun.config.model import RayOptions

    spec = RolesSpec((GroupSpec("big", 2, 16, ("big",)),), source="x.yaml", ray=RayOptions(placement_timeout_s=2))
    with pytest.raises(LaunchError, match=r"x\.yaml: role\(s\) big: 2 worker\(s\) .* within ray\.placement_timeout_s=2 s") as failed:
        make_placement(spec, spec.groups[0], Gang(spec.ray, spec.source))
    assert failed.value.exit_code == 2
    assert not [p for p in ray.util.placement_group_table().values()
                if p.get("name", "").startswith("dualrun-big-") and p.get("state") != "REMOVED"]


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_every_combination_equal_on_ray_and_local(local_ray):
    local = Runtime(load_spec(ROLES), "local")
    on_ray = dualrun.WorkerGroup(Calc, "b", (2,))
    here = dualrun.WorkerGroup(Calc, "b", (2,), runtime=local)
    assert on_ray.backend == "ray" and here.backend == "local" and on_ray.size == here.size == 3
    xs = list(range(10))
    futures, expected = [], []
    for dispatch in DISPATCHES:
        for execute in EXECUTES:
            for collect in COLLECTS:
                kw = dict(dispatch=dispatch, execute=execute, collect=collect)
                futures.append(on_ray.run_async("apply", xs, scale=3, **kw))
                expected.append(here.run(Calc.apply, xs, scale=3, **kw))
    got = [f.result(timeout=60) for f in futures]
    assert got == expected
    assert got[7] == [0, 6, 12, 18, 25, 31, 37, 44, 50, 56]   # slice, all, flatten: x * 2 * 3 + rank
    on_ray.shutdown()
    here.shutdown()


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_proxy_on_ray_places_groups_on_their_own_gpus(local_ray):
    calc, where = Calc(3), Where()
    assert calc.times(list(range(7))) == [0, 3, 6, 9, 12, 15, 18]
    assert calc.head() == [0]
    a = [i["CUDA_VISIBLE_DEVICES"] for i in calc.groups["a"].info()]
    b = calc.where()
    c, d = where.c(), where.d()
    assert len(set(a)) == 2 and len(set(b)) == 3 and c == d          # colocated c and d share their GPU
    assert not set(a) & set(b) and not (set(a) | set(b)) & set(c)     # separate groups never share
    with pytest.raises(dualrun.WorkerError) as err:
        calc.fail_on(1)
    assert err.value.group == "b" and err.value.rank == 1
    assert "bad input on rank 1" in str(err.value) and "fail_on" in err.value.remote_traceback
    with pytest.raises(dualrun.WorkerError, match="b worker rank 0 failed in .*Broken.*cannot build"):
        dualrun.WorkerGroup(Broken, "b")
    with pytest.raises(dualrun.UnknownGroupError):
        dualrun.WorkerGroup(Sink, "nope")
    calc.shutdown()
    where.shutdown()


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_slice_moves_one_nth_per_worker(local_ray):
    group = dualrun.WorkerGroup(Sink, "b")
    batch = [bytes(64 * 1024) for _ in range(60)]   # ~3.9 MB
    total = sum(map(len, batch))
    assert group.run("take", batch, dispatch="slice") == [20, 20, 20]
    sliced = [s["bytes_in"] for s in group.stats()]
    assert group.run("take", batch) == [60, 60, 60]
    both = [s["bytes_in"] for s in group.stats()]
    broadcast = [b - s for b, s in zip(both, sliced)]
    for got in sliced:
        assert abs(got - total / 3) < 0.05 * total / 3, (sliced, total)
    for got in broadcast:
        assert abs(got - total) < 0.05 * total, (broadcast, total)
    group.shutdown()


# -- a group's own torch.distributed rendezvous ------------------------------------------------------------
class Reducer:
    """Joins its group's process group with no arguments (the group's RANK/WORLD_SIZE/MASTER_* env)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        ctx = dualrun.current()
        assert os.environ["RANK"] == str(ctx.rank) and os.environ["WORLD_SIZE"] == str(ctx.world_size)
        assert os.environ["MASTER_PORT"] == str(ctx.master_port)
        dist.init_process_group("gloo")

    def total(self, x):
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(x)])
        dist.all_reduce(t)
        return t.item(), dist.get_rank(), dist.get_world_size()

    def imported(self, name):
        return name in sys.modules


def by_rank(length, i, *args, **kwargs):
    """A dispatch function with ms-swift's signature `(n, i, *args, **kwargs) -> (args, kwargs)`."""
    return [args[0][i]], {}


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_a_two_worker_group_all_reduces_in_its_own_process_group(local_ray):
    group = dualrun.WorkerGroup(Reducer, "a")
    assert group.run("total", [1, 2], dispatch=by_rank) == [(3.0, 0, 2), (3.0, 1, 2)]
    group.shutdown()


def exit_on(obj, rank):
    """Worker `rank` dies in the middle of a collective; the other waits in it."""
    import torch
    import torch.distributed as dist

    if dist.get_rank() == rank:
        os._exit(3)
    dist.all_reduce(torch.ones(1))


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_a_local_two_worker_group_all_reduces_and_a_crash_names_the_worker():
    """Without Ray (torchrun, python) a group of two runs as two processes with the group's rendezvous."""
    from dataclasses import replace

    spec = load_spec(ROLES)
    on_gpus = replace(spec, groups=tuple(replace(g, devices=(2, 3)) if g.name == "a" else g for g in spec.groups))
    group = dualrun.WorkerGroup(Reducer, "a", runtime=Runtime(on_gpus, "local"))   # torchrun planned GPUs 2, 3
    pids = [i["pid"] for i in group.info()]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    # a class and calls that came by reference, plain answers: the workers stay free of Ray (cloudpickle's home).
    # Only where this process has no Ray loaded: a Ray driver's cloudpickle may send test classes by value.
    if "ray" not in sys.modules:
        assert group.run("imported", "ray") == [False, False]
    assert group.run(lambda obj: os.environ["CUDA_VISIBLE_DEVICES"]) == ["2", "3"]
    assert group.run("total", [1, 2], dispatch=by_rank) == [(3.0, 0, 2), (3.0, 1, 2)]
    with pytest.raises(dualrun.WorkerError, match=r"a worker rank 1 failed in exit_on: .*exited with code 3"):
        group.run(exit_on, 1)
    for pid in pids:   # both stopped: the one that died and the one left waiting in the all-reduce
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    group.shutdown()


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_local_workers_get_their_groups_rendezvous():
    runtime = Runtime(load_spec(ROLES), "local")
    group = dualrun.WorkerGroup(lambda: dualrun.current(), "a", runtime=runtime)
    ctxs = group.run(lambda ctx: ctx)
    assert [c.rank for c in ctxs] == [0, 1] and {c.world_size for c in ctxs} == {2}
    assert len({(c.master_addr, c.master_port) for c in ctxs}) == 1 and ctxs[0].master_port
    assert group.run(lambda ctx, x: x, [5, 7], dispatch=by_rank) == [5, 7]
    # docs/roles.md: a group of several workers gets copies of the arguments (as on Ray), a group of one the
    # caller's objects themselves
    batch = [1, 2]
    assert group.run(lambda ctx, xs: xs.append(9) or xs, batch) == [[1, 2, 9], [1, 2, 9]] and batch == [1, 2]
    one = dualrun.WorkerGroup(lambda: None, "c", runtime=runtime)
    assert one.size == 1 and one.run(lambda obj, xs: xs.append(9), batch) == [None] and batch == [1, 2, 9]


THREAD_MADE_GROUP = """
import json, os, threading, time
import dualrun
from dualrun.role_programs.runtime import Runtime
from dualrun.role_programs.spec import load_spec
runtime = Runtime(load_spec({"use_cpu": True, "roles": {"a": {"processes": 2}}}), "local")
made = {}
maker = threading.Thread(target=lambda: made.update(group=dualrun.WorkerGroup(lambda: None, "a", runtime=runtime)))
maker.start()
maker.join()
time.sleep(1.0)
print(json.dumps(made["group"].run(lambda obj: os.getpid())), flush=True)
time.sleep(120)
"""


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_a_group_made_in_a_thread_outlives_the_thread_but_not_the_process():
    """Local workers watch the process that made their group, not the thread (PR_SET_PDEATHSIG's unit)."""
    import json
    import signal
    import subprocess

    from helpers import eventually, gone

    proc = subprocess.Popen([sys.executable, "-c", THREAD_MADE_GROUP], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()   # the maker thread has ended: its workers still answer
        pids = json.loads(line) if line else []
        assert len(set(pids)) == 2, f"the group's workers did not survive their thread: {line!r}"
    finally:
        proc.send_signal(signal.SIGKILL)   # no cleanup runs: only the workers' own watch can end them
        proc.wait()
        proc.stdout.close()
    assert eventually(lambda: all(gone(pid) for pid in pids), timeout=10), [p for p in pids if not gone(p)]
