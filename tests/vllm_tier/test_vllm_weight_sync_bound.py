"""A weight-sync group that cannot form ends the job within its bound, naming both ends (issue 49): GRPO against a
real vLLM rollout server on CPU whose trainer rank 0 advertises an address no member can reach (`VLLM_HOST_IP` of
the trainers: 192.0.2.1, a documentation address with no route in the tier's loopback-only namespace), as an
interface or a filter between machines would. Before, both ends sat in the group's rendezvous for 600 s each (the
store's, then gloo's); now `weight_sync_timeout_s` bounds forming on both ends: the trainer's GroupNotFormed names
trainer rank 0's address and port and the rollout server, and the server's log names its worker's side. The probe
(`--restart_test`: GRPOTrainer first, as a script does) forms the group through TRL's VLLMClient."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import pytest

from vllm_helpers import TIER, assert_nothing_left, grpo_job, grpo_probe_argv

pytestmark = [*TIER, pytest.mark.timeout(600)]

BOUND_S = 15


def test_a_group_that_cannot_form_ends_the_job_within_its_bound_naming_both_ends(tmp_path, vllm_tiny):
    from ray_helpers import ray_env

    job = grpo_job(vllm_tiny, extra=f"weight_sync_timeout_s: {BOUND_S}\n")
    job = job.replace("train: {gpus: 1}", "train: {gpus: 1, env: {VLLM_HOST_IP: 192.0.2.1}}")
    assert "VLLM_HOST_IP" in job
    (tmp_path / "job.yaml").write_text(job)
    (tmp_path / "out").mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "dualrun", "launch", "--config_file", "job.yaml",
                             *grpo_probe_argv(vllm_tiny, ("--restart_test",))], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT,
                            env={**os.environ, **ray_env(TRL_EXPERIMENTAL_SILENCE="1")})
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), line) for line in proc.stdout))
    reader.start()
    try:
        proc.wait(timeout=540)
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join(timeout=30)
    ended = time.monotonic()
    out = "".join(line for _, line in lines)
    assert proc.returncode == 1, out[-4000:]
    healthy = next(t for t, line in lines if "rollout: server healthy at" in line)
    # the trainer loads its model after the server answers, then waits the bound (and a grace for the server's
    # answer); the old code waited 600 s
    assert ended - healthy < BOUND_S + 90, (ended - healthy, out[-3000:])
    server = re.search(r"rollout: server healthy at ([\d.]+:\d+)", out).group(1)
    failed = re.search(r"dualrun: error: train rank 0 failed \(exit code 1\): .*", out)
    assert failed, out[-4000:]
    assert re.search(rf"GroupNotFormed: the weight-sync group did not form within {BOUND_S} s "
                     rf"\(weight_sync_timeout_s\): trainer rank 0 at 192\.0\.2\.1:\d+ and the rollout server at "
                     rf"http://{re.escape(server)} \(rank 1 of 2\); trainer rank 0: .*; the server: ",
                     failed.group(0)), failed.group(0)
    log = (tmp_path / "logs" / "rollout-server-0.log").read_text()
    assert re.search(rf"dualrun gloo weight transfer: this replica's worker rank 1 of 2 did not form the weight-sync "
                     rf"group with trainer rank 0 at 192\.0\.2\.1:\d+ within {BOUND_S} s", log), log[-3000:]
    assert_nothing_left(out, str(tmp_path))


def test_a_join_the_server_refuses_ends_the_trainers_wait_at_once(monkeypatch):
    """The trainer's gloo end (vllm_client.open_endpoint, vLLM's own group building) against a server that refuses
    the join, as dualrun's router refuses an init whose world size is not the workers it counted: GroupNotFormed
    naming the server and its answer within seconds, not after weight_sync_timeout_s (set long here)."""
    from dualrun.light.ports import free_port
    from dualrun.weightsync.trainer.vllm_client import open_endpoint
    from dualrun.weightsync.wire import FORM_TIMEOUT_ENV, GroupNotFormed

    import vllm.distributed.utils  # noqa: F401 - imported before the clock starts
    import vllm.utils.network_utils  # noqa: F401

    monkeypatch.setenv(FORM_TIMEOUT_ENV, "300")
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")

    def refuse(info: dict) -> None:
        assert info["world_size"] == 2 and info["rank_offset"] == 1
        raise Exception("Request failed: 400, init_info.world_size 2 cannot hold rank_offset 1 plus the 2 workers")

    began = time.monotonic()
    with pytest.raises(GroupNotFormed) as caught:
        open_endpoint(free_port("127.0.0.1"), 1, refuse, "http://127.0.0.1:8000")
    assert time.monotonic() - began < 30, time.monotonic() - began
    assert str(caught.value) == ("the rollout server at http://127.0.0.1:8000 refused to join the weight-sync group, "
                                 "so it cannot form: Exception: Request failed: 400, init_info.world_size 2 cannot "
                                 "hold rank_offset 1 plus the 2 workers")
