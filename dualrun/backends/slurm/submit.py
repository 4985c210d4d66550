"""`dualrun launch --backend slurm --submit ...` from a login node: the batch script the plan needs, `sbatch`, the
job's output followed here, its exit code returned.

Why: the multi-node recipe people fail to write by hand (how many nodes, GPUs and CPUs per node, one launch on the
first node that starts every node's share with srun) is what the plan already knows. What the plan does not say
(time, partition, account, qos, more options) comes from the config's `slurm:` section (options.py), each an
`#SBATCH` line; sbatch's input variables (`SBATCH_TIMELIMIT`, `SBATCH_PARTITION`, `SBATCH_ACCOUNT`, ...) still win
over the script's lines, as with any sbatch, and sbatch passes the submitting shell's environment on (its default),
so the job runs with the variables of this shell. `batch_script` and `job_state` are pure.
"""
from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from dualrun.backends.slurm.options import sbatch_lines
from dualrun.contract.errors import LaunchError

POLL_S = 0.5
CALL_S = 30.0   # the longest a call to the controller (scontrol, scancel) may take
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE")


@dataclass(frozen=True)
class Shape:
    """What the allocation must hold: `nodes`, the trainer ranks on the fullest node (`tasks_per_node`: the
    ranks' srun step; the servers' steps overlap it), its GPUs, and CPUs per task such that every node holds a CPU
    for each process the plan puts there (ranks, engine replicas, routers: each step asks one CPU a task)."""

    nodes: int
    tasks_per_node: int
    gpus_per_node: int
    cpus_per_task: int = 1


def shape_of(plan: Any) -> Shape:
    """The allocation a plan needs (a `plan.processes.Plan` on the cluster the config implies)."""
    ranks = [sum(1 for p in plan.workers if p.node == n.index) for n in plan.cluster.nodes]
    gpus = [len({d for p in plan.processes if p.node == n.index for d in p.devices}) for n in plan.cluster.nodes]
    every = [sum(1 for p in plan.processes if p.node == n.index) for n in plan.cluster.nodes]
    tasks = max(ranks or [1]) or 1
    return Shape(len(plan.cluster.nodes), tasks, max(gpus or [0]), max(1, -(-max(every or [1]) // tasks)))


def batch_script(command: Sequence[str], cwd: str, shape: Shape, name: str, output: str,
                 options: Mapping[str, Any] | None = None) -> str:
    """The sbatch script: the allocation the plan needs, the `slurm:` section's lines (`options`) and one command,
    this launch without `--submit`."""
    lines = ["#!/bin/bash", f"#SBATCH --job-name={name}", f"#SBATCH --nodes={shape.nodes}",
             f"#SBATCH --ntasks-per-node={shape.tasks_per_node}", f"#SBATCH --cpus-per-task={shape.cpus_per_task}",
             f"#SBATCH --output={output}"]
    if shape.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={shape.gpus_per_node}")
    lines += sbatch_lines(options)
    lines += ["# written by `dualrun launch --submit`: one launch on the first node; it starts every node's share with "
              "srun", f"cd {shlex.quote(cwd)}", "exec " + " ".join(shlex.quote(c) for c in command), ""]
    return "\n".join(lines)


def job_state(shown: str) -> tuple[str | None, int | None]:
    """`scontrol -o show job ID`'s line -> (JobState, exit code: ExitCode's `code:signal`, 128 + signal when a
    signal ended it); (None, None) when SLURM no longer knows the job."""
    fields = dict(f.split("=", 1) for f in shown.split() if "=" in f)
    state = fields.get("JobState")
    code, _, sig = fields.get("ExitCode", "").partition(":")
    if not code.isdigit():
        return state, None
    return state, int(code) or (128 + int(sig) if sig.isdigit() and int(sig) else 0)


def submit(cfg: Any, plan: Any, command: Sequence[str], dry_run: bool, environ: Mapping[str, str]) -> int:
    """Write the script, `sbatch` it, follow its output to its end; the job's exit code."""
    cwd = os.getcwd()
    folder = os.path.abspath(os.path.expanduser(cfg.log_dir)) if cfg.log_dir else cwd
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = f"dualrun-{cfg.method}"
    output = os.path.join(folder, f"dualrun-slurm-{stamp}-%j.out")
    text = batch_script(command, cwd, shape_of(plan), name, output, plan.rendezvous.options)
    if dry_run:
        print(f"# dualrun dry run: backend=slurm --submit; nothing was submitted\n# sbatch --parsable "
              f"{os.path.join(folder, f'dualrun-slurm-{stamp}.sbatch')}\n{text}", end="")
        return 0
    if shutil.which("sbatch") is None:
        raise LaunchError("--submit needs SLURM's sbatch on this machine's PATH (a login node of the cluster)", 2)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"dualrun-slurm-{stamp}.sbatch")
    with open(path, "w") as f:
        f.write(text)
    env = {k: v for k, v in environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    done = subprocess.run(["sbatch", "--parsable", path], env=env, capture_output=True, text=True, cwd=cwd)
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise LaunchError(f"sbatch {path} failed: {why}", 2)
    job = done.stdout.strip().split(";")[0]
    print(f"dualrun: submitted SLURM job {job} ({path}); following {output.replace('%j', job)}", file=sys.stderr,
          flush=True)
    return follow(job, output.replace("%j", job), env)


def follow(job: str, output: str, env: Mapping[str, str]) -> int:
    """Print the job's output as it grows until it ends; its exit code. Ctrl-C (or SIGTERM) cancels the job: the
    launch inside it then stops every node's steps."""
    offset, state, code = 0, None, None

    def cancel(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, cancel)
    # explicitly: a process started in the background by a non-interactive shell inherits SIGINT ignored, and Python
    # then installs no KeyboardInterrupt of its own (an explicit `kill -INT` must still cancel)
    before_int = signal.signal(signal.SIGINT, cancel)
    try:
        while True:
            try:
                shown = subprocess.run(["scontrol", "-o", "show", "job", job], env=dict(env), capture_output=True,
                                       text=True, timeout=CALL_S).stdout
            except subprocess.TimeoutExpired:   # a busy controller: ask again
                continue
            state, code = job_state(shown)
            offset = _copy(output, offset)
            if state is None or state.split()[0] in ENDED:
                break
            time.sleep(POLL_S)
        time.sleep(POLL_S)   # the last lines the node's slurmd writes as the job ends
        _copy(output, offset)
    except KeyboardInterrupt:
        try:
            subprocess.run(["scancel", job], env=dict(env), capture_output=True, timeout=CALL_S)
        except subprocess.TimeoutExpired:   # a busy controller: say what to run rather than hang on it
            print(f"\ndualrun: scancel {job} did not answer within {CALL_S:g} s; run it again", file=sys.stderr,
                  flush=True)
            return 130
        print(f"\ndualrun: cancelled SLURM job {job}", file=sys.stderr, flush=True)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, before_int)
    if code is None:
        print(f"dualrun: SLURM job {job} ended ({state or 'no longer known to scontrol'}); its exit code is not "
              "known here", file=sys.stderr, flush=True)
        return 1
    if state != "COMPLETED" and code == 0:
        code = 1
    print(f"dualrun: SLURM job {job} {state.lower() if state else 'ended'} (exit code {code})", file=sys.stderr,
          flush=True)
    return code


def _copy(path: str, offset: int) -> int:
    """What `path` gained since `offset`, to this process's stdout; the new offset."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return offset
    if data:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    return offset + len(data)
