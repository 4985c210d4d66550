"""`dualrun scale ROLE N` and the channel it reaches a running job through: a real control channel on loopback in
this process (in front of a recording fleet that stands for the job's server set), the real CLI as a subprocess,
real registry files under DUALRUN_JOBS_DIR. Pure rules first (which job is asked)."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from dualrun.contract.errors import ScaleRefused
from dualrun.contract.job_token import HEADER, new_token
from dualrun.launchers import job_registry
from dualrun.launchers.job_control import JobControl, control_for, fleets_words, resizable
from dualrun.launchers.job_registry import JobRecord, RegistryRefused
from dualrun.launchers.scale_request import NO_JOB, NoJob, describe, pick
from helpers import free_port

pytestmark = pytest.mark.timeout(120)

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _record(run_id: str, started: float = 0.0, **kw) -> JobRecord:
    return JobRecord(run_id, kw.pop("pid", os.getpid()), kw.pop("address", "127.0.0.1:1"), "t" * 43, started,
                     kw.pop("config", "/x/job.yaml"), kw.pop("roles", {"rollout": {"replicas": 1, "min": 1, "max": 3}}))


# -- pure rules ------------------------------------------------------------------------------------------------
def test_which_job_is_asked():
    a, b = _record("dualrun-a"), _record("dualrun-b")
    with pytest.raises(NoJob, match=NO_JOB):
        pick([], None)
    with pytest.raises(NoJob, match=NO_JOB):
        pick([], "dualrun-a")
    assert pick([a], None) is a and pick([a, b], "dualrun-b") is b
    with pytest.raises(NoJob, match=r"2 dualrun jobs .* --job RUN_ID"):
        pick([a, b], None)
    with pytest.raises(NoJob, match=r"no running job dualrun-c; running: dualrun-a, dualrun-b"):
        pick([a, b], "dualrun-c")
    with pytest.raises(NoJob) as e:   # a forged id cannot forge a second line
        pick([a], "x\ny")
    assert "\n" not in str(e.value)


def test_the_resizable_roles_and_their_words():
    fleets = {"teacher": {"replicas": 2, "min": 1, "max": 2}, "rollout": {"replicas": 1, "min": 1, "max": 1}}
    assert resizable(fleets) == {"teacher": {"replicas": 2, "min": 1, "max": 2}}
    assert fleets_words({"rollout": {"replicas": 1, "min": 1, "max": 3}, "a": {"replicas": 0, "min": 0, "max": 1}}) \
        == "a: 0 now, 0-1; rollout: 1 now, 1-3"
    line = describe(_record("dualrun-a", 0.0))
    assert line.startswith("  dualrun-a  started ") and "config /x/job.yaml" in line and "rollout: 1 now, 1-3" in line
    assert "rollout: 2 now, 1-3" in describe(_record("dualrun-a"), {"rollout": {"replicas": 2, "min": 1, "max": 3}})


def test_a_record_round_trips_and_a_foreign_file_is_none():
    r = _record("dualrun-a", 12.5)
    assert JobRecord.from_json(r.to_json()) == r
    assert JobRecord.from_json("{") is None and JobRecord.from_json('{"run_id": "x"}') is None
    assert JobRecord.from_json(r.to_json().replace("dualrun-a", "../../etc/passwd")) is None


# -- the channel, the registry, the command --------------------------------------------------------------------
class RecordingFleet:
    """Stands for the job's server set (ServerSetBase.fleets/scale): bounds 1..3, records every resize asked."""

    def __init__(self, replicas: int = 1) -> None:
        self.replicas, self.calls = replicas, []

    def fleets(self) -> dict[str, dict[str, int]]:
        return {"rollout": {"replicas": self.replicas, "min": 1, "max": 3}}

    def scale(self, role: str, replicas: int) -> str:
        self.calls.append((role, replicas))
        if role != "rollout":
            raise ScaleRefused(f"no resizable fleet {role!r} in this job (resizable: rollout)")
        if not 1 <= replicas <= 3:
            raise ScaleRefused(f"{role}: {replicas} replicas is out of its bounds (min_replicas 1, max_replicas 3)")
        self.replicas = replicas
        return f"dualrun: {role}: {replicas} replicas now (1 joined in 0.1 s)"


@pytest.fixture
def jobs(tmp_path, monkeypatch) -> Path:
    where = tmp_path / "jobs"
    monkeypatch.setenv(job_registry.JOBS_DIR, str(where))
    return where


@pytest.fixture
def controls():
    started: list[JobControl] = []
    yield started
    for c in started:
        c.stop()


def _start(controls: list, run_id: str, fleet: object) -> JobControl:
    control = control_for(run_id, new_token(), fleet, "/x/job.yaml")
    assert control is not None
    controls.append(control)
    return control


def _scale(jobs: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, **{job_registry.JOBS_DIR: str(jobs)})
    return subprocess.run([sys.executable, "-m", "dualrun", "scale", *args], env=env, capture_output=True, text=True,
                          timeout=60)


def test_scale_reaches_the_job_and_prints_its_line_and_the_file_goes_with_the_control(jobs, controls, capsys):
    fleet = RecordingFleet()
    control = _start(controls, "dualrun-aaaa", fleet)
    assert "dualrun: job dualrun-aaaa: resize a fleet with `dualrun scale ROLE N` (rollout: 1 now, 1-3)" in \
        capsys.readouterr().err
    path = jobs / "dualrun-aaaa.json"
    assert stat.S_IMODE(os.stat(jobs).st_mode) == 0o700 and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    record = json.loads(path.read_text())
    assert record["address"] == control.address and record["address"].startswith("127.0.0.1:")
    assert record["token"] == control.token and record["pid"] == os.getpid() and record["config"] == "/x/job.yaml"

    r = _scale(jobs, "rollout", "2")
    assert r.returncode == 0 and r.stdout == "dualrun: rollout: 2 replicas now (1 joined in 0.1 s)\n", r
    assert "asking job dualrun-aaaa to resize rollout to 2" in r.stderr
    assert fleet.calls == [("rollout", 2)]

    r = _scale(jobs, "rollout", "4")   # the job's refusal: its line, exit 2
    assert r.returncode == 2 and r.stderr.strip().endswith(
        "dualrun: error: rollout: 4 replicas is out of its bounds (min_replicas 1, max_replicas 3)"), r
    assert fleet.calls[-1] == ("rollout", 4) and fleet.replicas == 2

    control.stop()
    assert not path.exists() and control.address is None
    r = _scale(jobs, "rollout", "1")
    assert r.returncode == 2 and r.stderr == f"dualrun: error: {NO_JOB}\n", r
    assert fleet.calls[-1] == ("rollout", 4)


def _call(control: JobControl, path: str, token: str | None, body: dict | None = None) -> int:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://{control.address}{path}", data=data, headers={HEADER: token} if token else {})
    try:
        with _OPENER.open(req, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def test_only_the_jobs_secret_reaches_the_fleet(jobs, controls):
    fleet = RecordingFleet()
    control = _start(controls, "dualrun-aaaa", fleet)
    ask = {"role": "rollout", "replicas": 2}
    assert _call(control, "/scale", None, ask) == 401 and _call(control, "/fleets", None) == 401
    assert _call(control, "/scale", "x" * 43, ask) == 403 and _call(control, "/fleets", new_token()) == 403
    assert fleet.calls == []
    assert _call(control, "/fleets", control.token) == 200
    assert _call(control, "/scale", control.token, {"role": "rollout", "replicas": -1}) == 400
    assert _call(control, "/scale", control.token, {"role": "rollout", "replicas": True}) == 400
    assert fleet.calls == []
    # a registry file whose secret is not the job's: the job refuses, the command says so (exit 1), nothing resized
    path = jobs / "dualrun-aaaa.json"
    path.write_text(path.read_text().replace(control.token, new_token()))
    r = _scale(jobs, "rollout", "2")
    assert r.returncode == 1 and "job dualrun-aaaa answered 403" in r.stderr and fleet.calls == [], r


def test_two_jobs_are_listed_and_job_picks_one(jobs, controls):
    first, second = RecordingFleet(), RecordingFleet(replicas=3)
    _start(controls, "dualrun-first", first)
    _start(controls, "dualrun-second", second)
    r = _scale(jobs, "rollout", "2")
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and len(lines) == 3, r
    assert lines[0].startswith("  dualrun-first  started ") and "config /x/job.yaml" in lines[0] and \
        "rollout: 1 now, 1-3" in lines[0]
    assert lines[1].startswith("  dualrun-second ") and "rollout: 3 now, 1-3" in lines[1]   # live counts
    assert lines[2] == "dualrun: error: 2 dualrun jobs with a scalable fleet are running: name one with --job RUN_ID"
    r = _scale(jobs, "rollout", "2", "--job", "dualrun-nope")
    assert r.returncode == 2 and r.stderr.strip().endswith(
        "no running job dualrun-nope; running: dualrun-first, dualrun-second"), r
    r = _scale(jobs, "rollout", "2", "--job", "dualrun-second")
    assert r.returncode == 0 and "rollout: 2 replicas now" in r.stdout, r
    assert first.calls == [] and second.calls == [("rollout", 2)]


def test_a_dead_launchers_file_is_ignored_and_removed(jobs, controls):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    job_registry.register(_record("dualrun-dead", pid=gone.pid))
    assert (jobs / "dualrun-dead.json").exists()
    r = _scale(jobs, "rollout", "2")
    assert r.returncode == 2 and NO_JOB in r.stderr, r
    assert not (jobs / "dualrun-dead.json").exists()


def test_a_job_that_ends_during_the_resize_is_one_line_and_exit_1(jobs, controls):
    """The set stopped while the new replica joined (FleetResize._grow's ScaleCutShort): a failure, not "N now"."""
    from dualrun.contract.errors import ScaleCutShort

    class Ending(RecordingFleet):
        def scale(self, role: str, replicas: int) -> str:
            raise ScaleCutShort(f"{role}: the job ended during the resize, before rollout server 1 joined (the "
                                "launch's output says why)")

    _start(controls, "dualrun-aaaa", Ending())
    r = _scale(jobs, "rollout", "2")
    assert r.returncode == 1 and r.stdout == "", r
    assert r.stderr.splitlines()[-1] == ("dualrun: error: job dualrun-aaaa: rollout: the job ended during the resize, "
                                         "before rollout server 1 joined (the launch's output says why)"), r


def test_a_job_gone_meanwhile_is_one_line_and_exit_1(jobs):
    job_registry.register(_record("dualrun-gone", address=f"127.0.0.1:{free_port()}"))   # our pid: alive; no channel
    r = _scale(jobs, "rollout", "2")
    assert r.returncode == 1 and len(r.stderr.splitlines()) == 2, r
    assert "job dualrun-gone is gone (its control channel at 127.0.0.1:" in r.stderr
    assert r.stderr.rstrip().endswith("refused the connection); nothing was resized")
    assert not (jobs / "dualrun-gone.json").exists()


def test_a_registry_others_may_read_is_refused_on_both_sides(jobs, controls, capsys):
    jobs.mkdir(mode=0o755)
    os.chmod(jobs, 0o755)
    r = _scale(jobs, "rollout", "2")
    assert r.returncode == 2 and r.stderr == (f"dualrun: error: {jobs}: the job registry holds jobs' secrets but "
                                              f"others may use it (mode 0755); run: chmod 700 {jobs}\n"), r
    fleet = RecordingFleet()
    assert control_for("dualrun-aaaa", new_token(), fleet, "") is None   # the job goes on without a channel
    err = capsys.readouterr().err
    assert err.startswith("dualrun: job dualrun-aaaa: no `dualrun scale` for this job: ") and "chmod 700" in err
    assert list(jobs.iterdir()) == []
    if os.getuid() == 0:   # a directory of another user's
        os.chmod(jobs, 0o700)
        os.chown(jobs, 4242, -1)
        r = _scale(jobs, "rollout", "2")
        assert r.returncode == 2 and "the job registry belongs to uid 4242, not to this user" in r.stderr, r
        with pytest.raises(RegistryRefused):
            job_registry.register(_record("dualrun-aaaa"))


def test_a_file_others_may_read_is_passed_over(jobs, controls):
    _start(controls, "dualrun-aaaa", RecordingFleet())
    os.chmod(jobs / "dualrun-aaaa.json", 0o644)
    assert job_registry.running_jobs() == []


@pytest.mark.parametrize("n", ["-1", "x", "1.5", "", "99999999999"])
def test_n_must_be_an_integer_of_zero_or_more(jobs, n):
    r = _scale(jobs, "rollout", n)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and "argument N: expected a number of replicas" \
        in r.stderr and "Traceback" not in r.stderr, r


def test_no_channel_without_a_resizable_role_or_a_fleet(jobs):
    fixed = RecordingFleet()
    fixed.fleets = lambda: {"rollout": {"replicas": 1, "min": 1, "max": 1}}
    assert control_for("dualrun-b", new_token(), fixed, "") is None
    assert control_for("dualrun-c", new_token(), object(), "") is None
    assert control_for("dualrun-d", "", RecordingFleet(), "") is None   # no secret, no channel
    assert not (jobs / "dualrun-b.json").exists() and not (jobs / "dualrun-c.json").exists()


def test_a_resize_under_way_does_not_hold_the_channel(jobs, controls):
    """A resize takes a replica's start: meanwhile the channel answers other requests."""
    entered, gate = threading.Event(), threading.Event()

    class SlowFleet(RecordingFleet):
        def scale(self, role: str, replicas: int) -> str:
            entered.set()
            gate.wait(30)
            return super().scale(role, replicas)

    control = _start(controls, "dualrun-slow", SlowFleet())
    env = dict(os.environ, **{job_registry.JOBS_DIR: str(jobs)})
    slow = subprocess.Popen([sys.executable, "-m", "dualrun", "scale", "rollout", "3"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert entered.wait(30)
        assert _call(control, "/fleets", control.token) == 200
    finally:
        gate.set()
    out, err = slow.communicate(timeout=60)
    assert slow.returncode == 0 and "rollout: 3 replicas now" in out, (out, err)
