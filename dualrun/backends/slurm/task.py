"""What each `srun` task runs first: torchrun's variables from SLURM's, then the command (the bootstrap every
backend's ranks run, or a server's engine) in its place.

`python -m dualrun.backends.slurm.task CMD...`. Why a shim: SLURM numbers a step's tasks (SLURM_PROCID,
SLURM_LOCALID, SLURM_NODEID) but sets none of the names torch and TRL read (RANK, LOCAL_RANK, WORLD_SIZE, ...); the
launcher gives the step what every task shares (MASTER_ADDR, MASTER_PORT, the plan's env) and each task fills in
its own here. `env_for` is pure; `main` only execs."""
from __future__ import annotations

import json
import os
import sys
from typing import Mapping

from dualrun.env.worker import rank_env

DEVICES = "DUALRUN_SLURM_DEVICES"        # JSON list: the step's node k -> the plan's GPUs there as positions among
                                         # the GPUs the step sees ("0,1"; "": none; null: as srun gave them)
ERROR_DIR = "DUALRUN_SLURM_ERROR_DIR"    # where rank R writes its error file, rank<R>.json
RANKS = "DUALRUN_SLURM_RANKS"            # "1": the step's tasks are trainer ranks (else a server: devices only)
RESTARTS = "DUALRUN_SLURM_RESTARTS"      # the attempt: TORCHELASTIC_RESTART_COUNT
MAX_RESTARTS = "DUALRUN_SLURM_MAX_RESTARTS"
NODES = "DUALRUN_SLURM_NODES"            # the job's nodes, comma-separated: a task finds a peer to route toward


def tasks_per_node(spec: str) -> list[int]:
    """SLURM's `2(x3),1` -> [2, 2, 2, 1]."""
    out: list[int] = []
    for part in filter(None, spec.split(",")):
        count, _, times = part.partition("(x")
        out += [int(count)] * (int(times.rstrip(")")) if times else 1)
    return out


def on_given(positions: str, given: str | None) -> str:
    """The plan's share (`positions` among the node's GPUs) of the GPUs the step was given (`given`: the
    CUDA_VISIBLE_DEVICES SLURM set for the step, the job's GPUs on this node; unset: the node's all, positions are
    ids). A position past them: ValueError (the plan asked for more GPUs than the allocation holds here)."""
    wanted = [p.strip() for p in positions.split(",") if p.strip()]
    ids = [g.strip() for g in (given or "").split(",") if g.strip()]
    if not wanted or given is None or not ids:
        return ",".join(wanted)
    if any(not p.isdigit() or int(p) >= len(ids) for p in wanted):
        raise ValueError(f"the plan puts GPU(s) {','.join(wanted)} (positions) here but the step was given "
                         f"CUDA_VISIBLE_DEVICES={given}: ask salloc/sbatch for more GPUs per node")
    return ",".join(ids[int(p)] for p in wanted)


def env_for(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables this task sets on top of what srun gave it (pure: a test gives it SLURM's variables)."""
    node = int(environ.get("SLURM_NODEID", "0"))
    out: dict[str, str] = {}
    devices = json.loads(environ.get(DEVICES) or "[]")
    if node < len(devices) and devices[node] is not None:
        out["CUDA_VISIBLE_DEVICES"] = on_given(devices[node], environ.get("CUDA_VISIBLE_DEVICES"))
    if environ.get(RANKS) != "1":
        return out
    rank = int(environ["SLURM_PROCID"])
    per_node = tasks_per_node(environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE", "1"))
    error_dir = environ.get(ERROR_DIR, "")
    out.update(rank_env(
        rank=rank, world_size=int(environ.get("SLURM_STEP_NUM_TASKS") or environ["SLURM_NTASKS"]),
        local_rank=int(environ.get("SLURM_LOCALID", "0")), local_world_size=per_node[min(node, len(per_node) - 1)],
        node_rank=node, num_nodes=int(environ.get("SLURM_STEP_NUM_NODES") or environ.get("SLURM_NNODES", "1")),
        master_addr=environ["MASTER_ADDR"], master_port=environ["MASTER_PORT"],
        restart_count=int(environ.get(RESTARTS, "0")), max_restarts=int(environ.get(MAX_RESTARTS, "0")),
        run_id=environ.get("TORCHELASTIC_RUN_ID", "none"),
        error_file=os.path.join(error_dir, f"rank{rank}.json") if error_dir else "",
        omp_num_threads=environ.get("OMP_NUM_THREADS", "1")))
    return out


def peer_of(environ: Mapping[str, str]) -> str | None:
    """Pure: another node of the job than this task's (`SLURMD_NODENAME`), None on a job of one node."""
    here = environ.get("SLURMD_NODENAME", "")
    return next((n for n in (environ.get(NODES) or "").split(",") if n and n != here), None)


def network_here(environ: Mapping[str, str]) -> dict[str, str]:
    """A task of a job across nodes: GLOO_SOCKET_IFNAME, the interface of this node holding its address on the
    route to another node of the job, and for a rank VLLM_HOST_IP, that address (as trainer rank 0 it is the
    weight-sync group's master, which the engines on other nodes dial), where the env names none (the user's value
    wins). Unset, gloo binds what the host name resolves to: loopback on a node whose /etc/hosts maps its name to
    127.0.1.1 (Debian's default), which the other nodes cannot reach; vLLM's get_ip() gives the route out, another
    network's where the default route is not the cluster's (torchrun's launcher gives its machines the same,
    light/interfaces.py)."""
    peer = peer_of(environ)
    if peer is None:
        return {}
    from dualrun.light.interfaces import gloo_ifname, interfaces, reached_at
    from dualrun.weightsync.sync_group import node_host_env

    here = reached_at(peer)
    found = gloo_ifname(environ, here, interfaces())
    out = {"GLOO_SOCKET_IFNAME": found.name} if found is not None else {}
    return {**out, **node_host_env(environ, here)} if environ.get(RANKS) == "1" else out


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: python -m dualrun.backends.slurm.task CMD [ARGS...]")
    try:
        own = env_for(os.environ)
    except ValueError as e:
        sys.exit(f"dualrun: {os.environ.get('SLURMD_NODENAME', 'this node')}: {e}")
    env = {**os.environ, **own, **network_here(os.environ)}
    os.execvpe(argv[0], argv, env)


if __name__ == "__main__":
    main(sys.argv[1:])
