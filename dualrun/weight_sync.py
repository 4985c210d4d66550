"""The weight-sync handshake of `dualrun check`: who joins the trainer's weight-sync group, and what each saw.

Why: TRL's trainer pushes its weights to the rollout engines over one torch.distributed group (NCCL on GPUs, gloo
on CPU) - rank 0 the trainer (the rendezvous master: a TCPStore on trainer rank 0's node, at the address vLLM's
`get_ip()` gives and the job's `vllm_group_port`), then each engine replica's workers from its rank offset on.
Across nodes this group is the commonest place a job hangs (a firewalled port, a wrong interface), and only after
every model has loaded. The check forms the same group, on the same nodes, with a port picked the way the job
picks it, before anything loads, and moves one small tensor through it (`dualrun.weight_sync_probe`).

Standard library only: the Ray tasks of the check import it without torch; the probe runs in a child process
(its own environment - the interface variables of the role - and a hard time limit).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from dualrun.config.model import JobConfig
from dualrun.plan import Plan
from dualrun.engine_shape import engine_of, engine_size
from dualrun.serving.routing import rank_offsets

TIMEOUT_S = 30.0          # forming the group and the broadcast, per member
_START_S = 90.0           # on top: a fresh interpreter importing torch on a busy node
# The variables that decide which interface and address the group uses (torch's gloo and NCCL, vLLM's get_ip).
NET_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "VLLM_HOST_IP", "HOST_IP")


@dataclass(frozen=True)
class Member:
    """One process of the group as the job runs it: the trainer's rank 0, or one engine replica (its workers)."""

    label: str
    node: int
    ranks: tuple[int, ...]
    env: Mapping[str, str] = field(default_factory=dict)   # its interface variables (NET_VARS) in the job

    @property
    def name(self) -> str:
        if self.ranks == (0,):
            return self.label
        if len(self.ranks) == 1:
            return f"{self.label} (rank {self.ranks[0]})"
        return f"{self.label} (ranks {self.ranks[0]}-{self.ranks[-1]})"


@dataclass(frozen=True)
class SyncGroup:
    """The trainer's weight-sync group: `members[0]` is trainer rank 0, the master; NCCL when the engines have
    GPUs (and trainer rank 0's node has CUDA: the master decides, as TRL's trainer does from its device)."""

    members: tuple[Member, ...]
    world_size: int
    gpus: bool

    @property
    def master(self) -> Member:
        return self.members[0]


def syncs_weights(cfg: JobConfig) -> bool:
    """Pure: whether the job has a weight-sync group: a separate rollout that dualrun starts on vLLM (a server you
    run yourself is not placed by dualrun; the transformers CPU engine has no weight-transfer endpoints)."""
    role = cfg.role("rollout")
    return (role is not None and cfg.is_separate("rollout") and not role.address
            and engine_of(cfg, role) == "vllm")


def sync_group(cfg: JobConfig, plan: Plan) -> SyncGroup | None:
    """Pure: the group the job would form on `plan`, or None where it has none."""
    if not syncs_weights(cfg):
        return None
    role = cfg.role("rollout")
    assert role is not None
    rank0 = next((p for p in plan.workers if p.rank == 0), None)
    replicas = [p for p in plan.processes if p.kind == "server" and "rollout" in p.roles]
    if rank0 is None or not replicas:
        return None
    size = engine_size(cfg, role)
    offsets = rank_offsets([size] * len(replicas), 1)
    gpus = role.gpus > 0
    # torchrun: the plan's devices are the process's own; on Ray the member's task is given its GPUs by Ray
    own_devices = gpus and cfg.backend == "torchrun"
    members = [Member("trainer rank 0", rank0.node, (0,), net_env(rank0.env, own_devices))]
    members += [Member(f"rollout server {p.rank}", p.node, tuple(range(first, first + size)),
                       net_env(p.env, own_devices)) for p, first in zip(replicas, offsets)]
    return SyncGroup(tuple(members), 1 + size * len(replicas), gpus)


def net_env(env: Mapping[str, str], devices: bool = False) -> dict[str, str]:
    """The variables of a process's env the group depends on: its interface ones, and its GPUs where asked."""
    return {k: v for k, v in env.items() if k in NET_VARS or (devices and k == "CUDA_VISIBLE_DEVICES")}


def port_host(cfg: JobConfig) -> str:
    """Where the job picks its free weight-sync port on trainer rank 0's node: loopback for one torchrun machine,
    every address otherwise (the Ray rank 0 actor picks on all of them too)."""
    return "127.0.0.1" if cfg.backend == "torchrun" and cfg.num_machines == 1 else "0.0.0.0"


def advertised_address(env: Mapping[str, str] | None = None) -> str:
    """The address trainer rank 0 gives the engines as `master_address`: TRL passes vLLM's `get_ip()`, which is
    VLLM_HOST_IP (or HOST_IP) when set, else this host's address on its route out (no packet is sent), else
    0.0.0.0 (vLLM warns; only this machine can then reach it)."""
    env = os.environ if env is None else env
    if env.get("VLLM_HOST_IP") or env.get("HOST_IP"):
        return env.get("VLLM_HOST_IP") or env["HOST_IP"]
    for family, peer in ((socket.AF_INET, "8.8.8.8"), (socket.AF_INET6, "2001:4860:4860::8888")):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((peer, 80))
                return s.getsockname()[0]
        except OSError:
            continue
    return "0.0.0.0"


def master_endpoint(host: str, env: Mapping[str, str]) -> tuple[str, int]:
    """On trainer rank 0's node: the address it advertises and a free port, picked as the job picks it."""
    from dualrun.light.ports import free_port

    return advertised_address({**os.environ, **env}), free_port(host)


def member_spec(group: SyncGroup, member: Member, address: str, port: int,
                timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    return {"address": address, "port": port, "world_size": group.world_size, "ranks": list(member.ranks),
            "gpus": group.gpus, "timeout_s": timeout_s, "env": dict(member.env)}


def start_member(spec: Mapping[str, Any]) -> subprocess.Popen:
    """The probe in a child process (it dies with this one), with the member's interface variables. Its stderr
    goes to a file (`NCCL_DEBUG=INFO` can say more than a pipe holds while nobody reads it)."""
    from dualrun.light.parent_death import die_with_parent

    env = {**os.environ, **spec["env"]}
    err = tempfile.TemporaryFile("w+", errors="replace")
    proc = subprocess.Popen([sys.executable, "-m", "dualrun.weight_sync_probe", json.dumps(spec)], env=env,
                            stdout=subprocess.PIPE, stderr=err, text=True, preexec_fn=die_with_parent)
    proc.err_file = err  # type: ignore[attr-defined]
    return proc


def member_result(proc: subprocess.Popen, limit_s: float) -> dict[str, Any]:
    """What the probe reported (its last stdout line), or why it reported nothing within `limit_s`."""
    err = proc.err_file  # type: ignore[attr-defined]
    try:
        out, _ = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        err.close()
        return {"ok": False, "timeout": True, "error": f"no answer within {limit_s:g} s"}
    err.seek(0)
    tail = (err.read().strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
    err.close()
    try:
        return json.loads(out.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"ok": False, "timeout": False, "error": tail}


def run_member(spec: Mapping[str, Any]) -> dict[str, Any]:
    """One member, start to end (what a Ray task of the check runs on the member's node)."""
    return member_result(start_member(spec), float(spec["timeout_s"]) + _START_S)


def limit_s(timeout_s: float = TIMEOUT_S) -> float:
    return timeout_s + _START_S


def is_hard(result: Mapping[str, Any] | None) -> bool:
    """A member that failed on its own (not by waiting for the others): the cause, once seen the check stops."""
    return result is not None and not result.get("ok") and not result.get("timeout")


def unanswered(results: list[dict[str, Any] | None], why: str) -> list[dict[str, Any] | None]:
    """Members still silent when the check stopped waiting: a timeout of their own, unless another member's
    failure stopped it (then they are left out of the report)."""
    if any(is_hard(r) for r in results):
        return results
    return [{"ok": False, "timeout": True, "error": why} if r is None else r for r in results]


def verdict(group: SyncGroup, results: Sequence[Mapping[str, Any] | None], node_names: Mapping[int, str],
            address: str, port: int) -> tuple[list[str], str | None]:
    """Pure: (problem lines, or the success line). A member that failed on its own is the cause: the others'
    timeouts (they wait for it) are left out; `None` stands for a member stopped before it answered (`unanswered`).
    """
    hard = [(m, r) for m, r in zip(group.members, results) if is_hard(r)]
    failed = hard or [(m, r or {"error": "stopped"}) for m, r in zip(group.members, results) if not (r or {}).get("ok")]
    at = lambda node: node_names.get(node, f"node {node}")  # noqa: E731
    if failed:
        lines = []
        for m, r in failed:
            backend = r.get("backend") or ("gloo or NCCL" if group.gpus else "gloo")
            ifnames = ", ".join(f"{k}={v}" for k, v in m.env.items() if k.endswith("IFNAME"))
            lines.append(f"weight sync ({backend}, trainer rank 0 at {address}:{port}): {at(m.node)}: {m.name}"
                         f"{' with ' + ifnames if ifnames else ''}: {r.get('error')}{_hint(group, m, r, address)}")
        return lines, None
    master = results[0] or {}
    rest = "; ".join(f"{m.name} on {at(m.node)}" for m in group.members[1:])
    return [], (f"weight sync: {master.get('backend')} group of {group.world_size} at {address}:{port} (trainer "
                f"rank 0 on {at(group.master.node)}; {rest}) moved a tensor in {float(master.get('seconds', 0)):.2f} s")


def _hint(group: SyncGroup, member: Member, result: Mapping[str, Any], address: str) -> str:
    """vLLM's get_ip() falls back to 0.0.0.0 where it finds no route out: another node then dials itself."""
    if address != "0.0.0.0" or member.node == group.master.node or not result.get("timeout"):
        return ""
    return ("; trainer rank 0 advertises 0.0.0.0 (vLLM's get_ip() found no route out there): set VLLM_HOST_IP "
            "in roles.train.env to the address the engines reach it at")


def run_specs(specs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any] | None]:
    """Members on this machine, one child each, all at once: each one's result (None: still silent when the check
    stopped waiting, at the limit or at the first member that failed on its own)."""
    procs = [start_member(spec) for spec in specs]
    results: list[dict[str, Any] | None] = [None] * len(procs)
    deadline = time.monotonic() + max((limit_s(float(s["timeout_s"])) for s in specs), default=0.0)
    try:
        while any(r is None for r in results) and time.monotonic() < deadline:
            for i, p in enumerate(procs):
                if results[i] is None and p.poll() is not None:
                    results[i] = member_result(p, 5.0)
            if any(is_hard(r) for r in results):
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
            p.err_file.close()  # type: ignore[attr-defined]
    return results


def run_local(group: SyncGroup, address: str, port: int, node_names: Mapping[int, str],
              timeout_s: float = TIMEOUT_S) -> tuple[list[str], str | None]:
    """Every member on this machine (torchrun, or a Ray job on an embedded cluster): one child each, stopped at
    the first member that fails on its own."""
    results = run_specs([member_spec(group, m, address, port, timeout_s) for m in group.members])
    return verdict(group, unanswered(results, f"no answer within {limit_s(timeout_s):g} s"), node_names, address,
                   port)
