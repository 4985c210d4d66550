"""Fleets on several torchrun machines (127.0.0.1): a serving machine that comes and goes while GKD trains.

Machine 0 runs both trainer ranks, teacher replica 0 and the router; machine 1 runs no ranks and only teacher
replica 1, above `min_replicas`: an optional machine (plan/optional.py). The job starts without it. Launched while
the trainers wait at a gate (step 2), machine 1 joins: machine 0's router takes its replica in and the next steps
use both. SIGTERMed at the next gate (step 4), it leaves: machine 0 drains its replica first, machine 1 exits 0, and
the job ends 0 with the losses of the same job on a fixed fleet (the teacher is deterministic whichever replica
answers). Lost below `min_replicas` (machine 0's own replica left first, then machine 1 SIGKILLed), the job ends,
naming machine 1's replica. Nothing is left running on either machine."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ASSETS, eventually, pids_matching
from test_replicas_e2e import RESTART_STEPS, _engines, _losses, unkilled  # noqa: F401 - the fixed fleet's losses

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(420)]


def _launch(tmp_path: Path, tiny: Path, rank: int, port: int, teacher: str = "") -> subprocess.Popen:
    """Machine `rank`'s launcher (cwd: tmp_path for machine 0, tmp_path/m1 for machine 1; stderr in its `err`),
    in a session of its own (a SIGKILL of its group is the machine lost)."""
    here = tmp_path if rank == 0 else tmp_path / f"m{rank}"
    here.mkdir(exist_ok=True)
    (here / "job.yaml").write_text(
        "use_cpu: true\nmethod: gkd\nlog_dir: logs\ntorchrun: {gpus_per_machine: 3}\nroles:\n"
        "  train: {gpus: 2, machines: [0]}\n"
        f"  teacher: {{gpus: 1, max_replicas: 2, model: {tiny / 'teacher'}, top_k: 5, health_timeout_s: 120, "
        f"{teacher}server_args: [--verbose]}}\n")
    (here / "out").mkdir(exist_ok=True)
    env = dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1", DUALRUN_JOBS_DIR=str(tmp_path / f"jobs{rank}"))
    with open(here / "err", "w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "dualrun", "launch", "--backend", "torchrun", "--config_file", "job.yaml",
             "--num_machines", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
             "--main_process_port", str(port), str(ASSETS / "gkd_probe.py"),
             "--model_name_or_path", str(tiny / "model"), "--teacher_model_name_or_path", str(tiny / "teacher"),
             "--data", str(tiny / "data" / "gkd.jsonl"), "--output_dir", "out", "--max_steps", str(RESTART_STEPS),
             "--hold_file", str(tmp_path / "gate"), "--hold_steps", "2,4"],
            cwd=here, env=env, stdout=subprocess.DEVNULL, stderr=err, text=True, start_new_session=True)


def _held(tmp_path: Path, step: int) -> bool:
    return all(Path(f"{tmp_path / 'gate'}.{step}.held{r}").exists() for r in (0, 1))


def _start(tmp_path: Path, tiny: Path, teacher: str = "") -> tuple[int, subprocess.Popen]:
    """Machine 0 alone, held at the gates (steps 2 and 4): the job runs without machine 1."""
    from dualrun.light.ports import free_port

    port = free_port()
    for step in (2, 4):
        Path(f"{tmp_path / 'gate'}.{step}").touch()
    zero = _launch(tmp_path, tiny, 0, port, teacher)
    assert eventually(lambda: zero.poll() is not None or _held(tmp_path, 2), timeout=240), _err(tmp_path, 0)
    assert zero.poll() is None, _err(tmp_path, 0)
    return port, zero


def _err(tmp_path: Path, rank: int) -> str:
    return ((tmp_path if rank == 0 else tmp_path / f"m{rank}") / "err").read_text()[-4000:]


def _join(tmp_path: Path, tiny: Path, port: int, zero: subprocess.Popen, teacher: str = "") -> tuple[
        subprocess.Popen, str]:
    """Machine 1 launched late; once machine 0 says its replica joined: the process and the replica's address."""
    one = _launch(tmp_path, tiny, 1, port, teacher)
    joined = lambda: re.search(r"dualrun: teacher server 1 joined at (127\.0\.0\.1:\d+) with machine 1, serving "  # noqa: E731
                               r"from the trainer's next request \(its last was of step 1\), [\d.]+ s after machine "
                               r"1 offered it; 2 of max 2 replicas run", _err(tmp_path, 0))
    assert eventually(lambda: zero.poll() is not None or one.poll() is not None or joined(), timeout=240), \
        (_err(tmp_path, 0), _err(tmp_path, 1))
    assert zero.poll() is None and one.poll() is None, (_err(tmp_path, 0), _err(tmp_path, 1))
    return one, joined().group(1)


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def test_a_serving_machine_started_late_joins_then_sigterm_drains_it_and_gkd_gives_the_fixed_fleets_losses(
        tmp_path, module_tiny, unkilled):  # noqa: F811
    tiny = module_tiny
    port, zero = _start(tmp_path, tiny)
    one = None
    try:
        assert "joined" not in _err(tmp_path, 0)   # two steps on machine 0's replica alone
        one, _ = _join(tmp_path, tiny, port, zero)
        os.unlink(f"{tmp_path / 'gate'}.2")   # steps 3 and 4 on both replicas
        assert eventually(lambda: zero.poll() is not None or _held(tmp_path, 4), timeout=240), _err(tmp_path, 0)
        served = (tmp_path / "m1" / "logs" / "teacher-server-1.log").read_text().count('"POST /v1/completions')
        assert served >= 1, "machine 1's replica served no request"
        one.send_signal(signal.SIGTERM)   # its launcher: machine 0 drains its replica, then it stops it
        assert one.wait(timeout=120) == 0, _err(tmp_path, 1)
        assert "dualrun: teacher server 1 left (machine 1 stopped by SIGTERM; drained); 1 of min 1 remain" in \
            _err(tmp_path, 0), _err(tmp_path, 0)
        assert "dualrun: machine 1 left the job (SIGTERM): machine 0 took its replicas out of rotation and drained " \
            "them" in _err(tmp_path, 1), _err(tmp_path, 1)
        os.unlink(f"{tmp_path / 'gate'}.4")   # steps 5 and 6 on machine 0's replica alone again
        code = zero.wait(timeout=240)
    finally:
        _stop(zero, *([one] if one else []))
    assert code == 0, _err(tmp_path, 0)
    assert "stopped answering" not in _err(tmp_path, 0) and "restarting" not in _err(tmp_path, 0)
    assert re.search(r"dualrun: fleet: teacher server 1 joined [\d.]+ s after machine 1 offered it, serving from step "
                     r"[23]; teacher server 1 left \(machine 1 stopped by SIGTERM; drained\)\n", _err(tmp_path, 0)), \
        _err(tmp_path, 0)   # the job's summary: the step of the first request machine 1's replica answered
    assert _losses(tmp_path, RESTART_STEPS) == unkilled["losses"]
    assert eventually(lambda: not _engines(tiny) and not pids_matching(str(tmp_path))), pids_matching(str(tmp_path))


def test_a_serving_machine_lost_below_min_replicas_ends_the_job_naming_its_replica(tmp_path, module_tiny):
    """`replica_restarts: 0`: machine 0's own replica, SIGKILLed, leaves (machine 1's serves); then machine 1 is
    lost (its launcher and its engine SIGKILLed): none would remain, so the job ends naming machine 1's replica."""
    tiny = module_tiny
    port, zero = _start(tmp_path, tiny, "replica_restarts: 0, ")
    one = None
    try:
        one, address = _join(tmp_path, tiny, port, zero, "replica_restarts: 0, ")
        theirs = pids_matching(f"--port {address.rpartition(':')[2]}")
        [ours] = [p for p in _engines(tiny) if p not in theirs]
        os.kill(ours, signal.SIGKILL)
        assert eventually(lambda: "dualrun: teacher server 0 left (died: " in _err(tmp_path, 0), timeout=60), \
            _err(tmp_path, 0)
        assert "1 of min 1 remain" in _err(tmp_path, 0) and zero.poll() is None, _err(tmp_path, 0)
        os.killpg(one.pid, signal.SIGKILL)   # machine 1 lost: its launcher and its engine, at once
        for pid in theirs:
            os.kill(pid, signal.SIGKILL)
        one.wait()
        os.unlink(f"{tmp_path / 'gate'}.2")
        os.unlink(f"{tmp_path / 'gate'}.4")
        code = zero.wait(timeout=120)
    finally:
        _stop(zero, *([one] if one else []))
    assert code != 0, _err(tmp_path, 0)
    assert re.search(r"dualrun: error: teacher server 1 on machine 1 stopped answering its health check",
                     _err(tmp_path, 0)), _err(tmp_path, 0)
    assert eventually(lambda: not _engines(tiny) and not pids_matching(str(tmp_path))), pids_matching(str(tmp_path))
