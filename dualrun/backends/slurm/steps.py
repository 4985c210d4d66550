"""The `srun` command lines of a job (pure: what `--dry_run` shows is what the launch runs).

Why `--overlap`: the ranks' step and every server's step share the allocation's CPUs and GPUs, as the plan
divides them, not as SLURM would carve them.

Why the GPUs go by CUDA_VISIBLE_DEVICES, not `--gpus-per-task` or `--gres` on each step: a step that asks for no
GPUs is given all of the job's GPUs on its nodes (srun's default), and the task shim narrows each task to the
plan's share of them (`device_positions`: the plan's devices as positions among the node's, mapped through the
GPUs SLURM gave the step, so that on a node shared with other jobs position 0 is this job's first GPU, not the
node's). `--gpus-per-task=1` would put each rank alone with its GPU under cgroup-constrained devices, and NCCL's
peer-to-peer between the ranks of a node needs them to see each other's (torchrun's ranks see the node's trainer
GPUs, LOCAL_RANK picks one; SLURM users running torchrun ask for the node's GPUs once for the same reason); and
overlapping steps share GRES too (`--overlap`, SLURM 21.08+), so per-step `--gres` would not keep the servers'
GPUs apart from the ranks'. Why `--kill-on-bad-exit=1`: one rank that fails ends the step's other tasks at once, as
torchrun's agent does. Why `--export=ALL`: the step's env is the launcher's, built from the plan."""
from __future__ import annotations

import sys
from typing import Sequence

SHIM = ["-m", "dualrun.backends.slurm.task"]


def task_argv(cmd: Sequence[str], python: str | None = None) -> list[str]:
    """`cmd` behind the task shim (task.py), run by this node's interpreter (every node sees the same venv)."""
    return [python or sys.executable, *SHIM, *cmd]


def ranks_step(nodes: Sequence[str], per_node: int, cmd: Sequence[str], name: str = "dualrun-train",
               python: str | None = None) -> list[str]:
    """One step of `per_node` tasks on each of `nodes` (the trainers' machines, in allocation order): the ranks."""
    return ["srun", f"--job-name={name}", f"--nodes={len(nodes)}", f"--ntasks={len(nodes) * per_node}",
            f"--ntasks-per-node={per_node}", f"--nodelist={','.join(nodes)}", "--cpus-per-task=1",
            "--kill-on-bad-exit=1", "--overlap", "--export=ALL", "--unbuffered", *task_argv(cmd, python)]


def server_step(node: str, cmd: Sequence[str], name: str, python: str | None = None) -> list[str]:
    """One step of one task on `node`: an engine replica or a router."""
    return ["srun", f"--job-name={name}", "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--cpus-per-task=1",
            "--overlap", "--export=ALL", "--unbuffered", *task_argv(cmd, python)]


def device_positions(visible: str | None, node_ids: Sequence[int]) -> str | None:
    """A process's CUDA_VISIBLE_DEVICES in the plan (ids of its node, `node_ids` in the node's order) -> the
    positions of those ids among the node's (`"4,5"` on a node of ids 4..7 -> `"0,1"`), what the task shim maps
    through the GPUs SLURM gave the step. None stays None (as srun gave it), "" stays "" (no GPU)."""
    if visible is None or not visible.strip():
        return visible
    order = list(node_ids)
    ids = [int(part) for part in visible.split(",") if part.strip()]
    return ",".join(str(order.index(i) if i in order else i) for i in ids)


def step_name(label: str, tag: str) -> str:
    """A server's label (`teacher server 0`) as a step name SLURM shows (`dualrun-teacher-server-0-<tag>`): the
    launch's run id as `tag`, so that its steps are found (and cancelled) by name."""
    return "-".join(["dualrun", *label.split(), tag])


def failed_tasks(lines: Sequence[str]) -> list[tuple[int, int]]:
    """srun's own error lines -> (task, exit code), in the order srun reported them:
    `srun: error: node1: task 1: Exited with exit code 3`, `srun: error: node1: tasks 0-1: Killed`."""
    import re

    out: list[tuple[int, int]] = []
    for line in lines:
        m = re.match(r"srun: error: [^:]+: tasks? ([0-9,\-]+): (.*)", line.strip())
        if not m:
            continue
        code_m = re.search(r"exit code (\d+)", m.group(2))
        sig_m = re.search(r"(Killed|Terminated)", m.group(2))
        code = int(code_m.group(1)) if code_m else (-9 if sig_m and sig_m.group(1) == "Killed" else -15 if sig_m else 1)
        for part in m.group(1).split(","):
            lo, _, hi = part.partition("-")
            out += [(t, code) for t in range(int(lo), int(hi or lo) + 1)]
    return out
