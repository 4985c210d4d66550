"""GRPO with a real vLLM rollout (the CPU build) alone on machine 1 of the virtual cluster (tests/vcluster.py) and the
both trainer ranks on machine 0, the layout TRL's docs teach (`trl vllm-serve` on one node, training on another):
`roles.train.machines: [0]`, `roles.rollout.machines: [1]`. Machine 1's launcher runs no torchrun agent; the
trainer's weights cross the link before every generation over gloo (trainer rank 0 at machine 0's address, the
engine's worker at machine 1's), every sync lands (the probe's checks, as in tests/test_vllm_rollout.py), and the
training is the one-machine run's of the same job bit for bit: the same completions, rewards and losses (the probe,
assets/grpo_server_probe.py, records them on rank 0, which alone holds TRL's vLLM client)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

import vcluster
from helpers import ASSETS, pids_matching
from vllm_helpers import TIER, assert_every_sync_landed, run_grpo_probe, server_role

pytestmark = [*TIER, pytest.mark.timeout(900),
              pytest.mark.skipif(vcluster.available() is not None, reason=f"{vcluster.available()}")]

ENV = {"TRL_EXPERIMENTAL_SILENCE": "1", "HF_HUB_OFFLINE": "1"}


def test_grpo_rollout_alone_on_machine_1_syncs_every_step_and_trains_as_one_machine(tmp_path, vllm_tiny):
    one = tmp_path / "one"
    one.mkdir()
    _, reference, _ = run_grpo_probe(one, vllm_tiny, "torchrun", None, trainers=2)
    work = tmp_path / "two"
    work.mkdir()
    config = ("use_cpu: true\nmethod: grpo\nlog_dir: logs\nroles:\n  train: {gpus: 2, machines: [0]}\n"
              + server_role("rollout", vllm_tiny / "model", health_timeout_s=400, machines="[1]"))
    main = vcluster.address(0)
    with vcluster.VCluster(2, shared=[tmp_path, vllm_tiny.parent]) as vc:
        procs = []
        for k in (0, 1):
            here = work / f"m{k}"
            (here / "out").mkdir(parents=True)
            (here / "job.yaml").write_text(config)
            argv = [sys.executable, "-m", "dualrun", "launch", "--config_file", "job.yaml", "--num_machines", "2",
                    "--machine_rank", str(k), "--main_process_ip", main, "--main_process_port", "29500",
                    str(ASSETS / "grpo_server_probe.py"), str(vllm_tiny / "model"),
                    str(vllm_tiny / "data" / "prompts.jsonl"), "out"]
            with open(here / "output", "w") as out:
                procs.append(vc.popen(k, argv, cwd=here, env={**os.environ, **ENV}, stdout=out,
                                      stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 600
        try:
            for p in procs:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        outs = [(work / f"m{k}" / "output").read_text() for k in (0, 1)]
        assert [p.returncode for p in procs] == [0, 0], [o[-4000:] for o in outs]
        left = [vc.run(k, ["ps", "-eo", "pid,args"], check=True).stdout.strip().splitlines()[1:] for k in (0, 1)]
        assert [[r for r in rows if r.split(None, 1)[0] != "1" and "ps -eo" not in r] for rows in left] == [[], []]
    address = re.search(r"rollout server 0: server healthy at ([\d.]+):(\d+) \(machine 1\)", outs[1])
    assert address and address.group(1) == vcluster.address(1), outs[1][-3000:]
    assert "torch.distributed.run" not in outs[1] and "job succeeded" in outs[1]
    assert "dualrun gloo weight transfer: rank 1 of 2" in (work / "m1" / "logs" / "rollout-server-0.log").read_text()
    rec = json.loads((work / "m0" / "out" / "rank0.json").read_text())
    assert rec["grpo"]["vllm_server_host"] == vcluster.address(1), rec["grpo"]
    assert_every_sync_landed(rec, replicas=1)
    same = ("generations", "rewards", "losses")
    assert {k: rec[k] for k in same} == {k: reference[k] for k in same}
    assert [c["trainer_greedy"] for c in rec["checks"]] == [c["trainer_greedy"] for c in reference["checks"]]
    assert not pids_matching(str(tmp_path))   # and inside each machine nothing at all (above)
