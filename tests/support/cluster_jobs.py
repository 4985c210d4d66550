"""The jobs the cluster tier runs on several machines, and the one-machine runs their losses are compared with.

Why one place: TRL's sft.py and the GKD probe run across torchrun machines (tests/cluster/test_cluster_torchrun.py) and
across Ray nodes (tests/cluster/test_cluster_ray.py), and each must give the losses of the same job on one machine. The
one-machine runs are session fixtures in conftest.py (`sft_one_machine`, `gkd_one_machine`), run once for both modules.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import shutil
import time
from pathlib import Path

from helpers import ASSETS, dualrun
from vcluster import address, hostname as vc_name

ENV = {"TRL_EXPERIMENTAL_SILENCE": "1", "HF_HUB_OFFLINE": "1"}
SFT_CONFIG = "use_cpu: true\nroles: {train: {gpus: 2}}\n"


def sft_script() -> str:
    """TRL's own scripts/sft.py, unchanged."""
    import trl

    return str(Path(trl.__file__).parent / "scripts" / "sft.py")


def sft_data(tiny: Path, work: Path) -> Path:
    """The tiny SFT data as TRL's sft.py takes it (`--dataset_name DIR` holding train.jsonl), under `work`."""
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    shutil.copy(tiny / "data" / "sft.jsonl", data / "train.jsonl")
    return data


def sft_args(tiny: Path, data: Path, out: Path) -> list[str]:
    """sft.py and its arguments: 3 steps of 2 examples per rank, seed 0, a loss logged every step."""
    return [sft_script(), "--model_name_or_path", str(tiny / "model"), "--dataset_name", str(data), "--output_dir",
            str(out), "--max_steps", "3", "--per_device_train_batch_size", "2", "--use_cpu", "true", "--report_to",
            "none", "--logging_steps", "1", "--seed", "0"]


def losses(out: Path) -> list[float]:
    """Every logged loss, at full precision (the console rounds them): the last checkpoint's trainer state."""
    [last] = sorted(out.glob("checkpoint-*"))
    return [h["loss"] for h in json.loads((last / "trainer_state.json").read_text())["log_history"] if "loss" in h]


def gkd_config(tiny: Path, extra: str = "") -> str:
    """A GKD job whose teacher has two CPU-engine replicas (behind a router), `extra` lines appended."""
    return ("use_cpu: true\nmethod: gkd\nroles:\n  train: {gpus: 2}\n"
            f"  teacher: {{gpus: 2, model: {tiny / 'teacher'}, top_k: 5, health_timeout_s: 120, "
            f"server_args: [--verbose]}}\n{extra}")


def gkd_args(tiny: Path, out: Path) -> list[str]:
    """tests/support/assets/gkd_probe.py (TRL's GKDTrainer, 2 steps; each rank writes its losses to
    out/rank{N}.json)."""
    return [str(ASSETS / "gkd_probe.py"), "--model_name_or_path", str(tiny / "model"), "--teacher_model_name_or_path",
            str(tiny / "teacher"), "--data", str(tiny / "data" / "gkd.jsonl"), "--output_dir", str(out)]


def gkd_losses(out: Path, rank: int = 0) -> list[float]:
    return json.loads((out / f"rank{rank}.json").read_text())["losses"]


def one_machine(work: Path, config: str, argv: list[str]) -> None:
    """`dualrun launch` on this machine (the test's own namespace), in `work`."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "job.yaml").write_text(config)
    proc = dualrun("launch", "--config_file", "job.yaml", *argv, cwd=work, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def debian_hosts(vc, machine: int) -> None:
    """Machine `machine`'s /etc/hosts as Debian writes it: its own name on 127.0.1.1. Unless told an interface, gloo
    there binds and advertises that loopback address, which the other machines cannot reach."""
    lines = ["127.0.0.1 localhost", f"127.0.1.1 {vc_name(machine)}"]
    lines += [f"{address(k)} {vc_name(k)}" for k in range(vc.size) if k != machine]
    vc.run(machine, ["sh", "-c", "cat > /etc/hosts"], input="\n".join(lines) + "\n", check=True)


def launch_on(vc, work: Path, argv: list[str], config: str, machines=(0, 1), env: dict | None = None
              ) -> list[subprocess.Popen]:
    """`dualrun launch --config_file job.yaml --num_machines 2 --machine_rank K --main_process_ip <machine 0> ARGV`
    on each machine K of `machines`, in work/mK (its job.yaml: `config` with MACHINE replaced by K, e.g. a log_dir
    of its own; its output in work/mK/out), `env` added to each one's."""
    procs = []
    for k in machines:
        here = work / f"m{k}"
        here.mkdir()
        (here / "job.yaml").write_text(config.replace("MACHINE", str(k)))
        with open(here / "out", "w") as out:
            procs.append(vc.popen(k, [sys.executable, "-m", "dualrun", "launch", "--config_file", "job.yaml",
                                      "--num_machines", "2", "--machine_rank", str(k), "--main_process_ip",
                                      address(0), "--main_process_port", "29500", *argv],
                                  cwd=here, env={**os.environ, **ENV, **(env or {})}, stdout=out,
                                  stderr=subprocess.STDOUT))
    return procs


def route_out_elsewhere(vc) -> None:
    """Each machine's route out through an interface of its own, `wan0` (10.99.K.1/24, a veth whose other end
    carries nothing further), as on nodes whose default route is a management or public network beside the
    cluster's: the cluster's subnet stays on eth0, where Ray's addresses are, but "this host's address on its route
    out" (vLLM's `get_ip()`) is the wan0 address, which no other machine reaches."""
    for k in range(vc.size):
        vc.run(k, f"ip link add wan0 type veth peer name wan0p && ip addr add 10.99.{k}.1/24 dev wan0 && "
                  "ip link set wan0 up && ip link set wan0p up && ip route replace default dev wan0", check=True)


def wait_all(procs: list[subprocess.Popen], timeout_s: float) -> None:
    """Wait for every launcher (`timeout_s` for all of them); what is left then is killed, and the wait fails: a hung
    machine must not outlive the test."""
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def outputs(work: Path, machines=(0, 1)) -> list[str]:
    """Each machine's launcher output, as `launch_on` writes it (work/mK/out)."""
    return [(work / f"m{k}" / "out").read_text() for k in machines]


def all_ended(procs: list[subprocess.Popen], work: Path, timeout: float) -> list[str]:
    """Each machine's output once all have ended (what is still running after `timeout` is killed: a failure)."""
    import pytest

    try:
        wait_all(procs, timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running after {timeout:g} s: {[o[-3000:] for o in outputs(work, range(len(procs)))]}")
    return outputs(work, range(len(procs)))


def left_on(vc, machine: int) -> list[str]:
    """Every process of `machine` but its first (the namespace's holder) and the `ps` that lists them."""
    rows = vc.run(machine, ["ps", "-eo", "pid,args"], check=True).stdout.strip().splitlines()[1:]
    return [r for r in rows if r.split(None, 1)[0] != "1" and "ps -eo" not in r]
