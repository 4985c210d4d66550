"""`dualrun check`'s rehearsal of the weight sync: the job's group (`group.py`) formed before any model loads, one
small tensor moved through it, then a payload as the sync moves weights (`probe.PAYLOAD_BYTES`), and what each
member saw: the rate each replica received it at, beside the speed its node reports for its link, so a user sees
before training what a sync will cost.

Each member runs `python -m dualrun.weightsync.probe` in a child process (its own environment - the interface
variables of its role - and a hard time limit); on Ray, a task on the member's node runs `run_member`.
Standard library only: the Ray tasks of the check import it without torch.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Mapping, Sequence

from dualrun.weightsync.sync_group import Member, SyncGroup, advertised_address

TIMEOUT_S = 30.0          # forming the group and the broadcast, per member
_START_S = 100.0          # on top: a fresh interpreter importing torch on a busy node, the members meeting
                          # (probe.START_S from the probe's start) and the probe's own slack


def master_endpoint(host: str, env: Mapping[str, str]) -> tuple[str, int]:
    """On trainer rank 0's node: the address it advertises and a free port, picked as the job picks it (`host`
    loopback: a one-machine job, whose trainers advertise loopback unless the user chose an address)."""
    from dualrun.light.ports import free_port

    env = {**os.environ, **env}
    return ("127.0.0.1" if host == "127.0.0.1" and not env.get("VLLM_HOST_IP") else advertised_address(env)), \
        free_port(host)


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
    proc = subprocess.Popen([sys.executable, "-m", "dualrun.weightsync.probe", json.dumps(spec)], env=env,
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


def run_member(spec: Mapping[str, Any], node_address: str | None = None) -> dict[str, Any]:
    """One member, start to end (what a Ray task of the check runs on the member's node). `node_address` (a cluster of
    several nodes): the node's Ray address, whose interface gloo gets where the member names none, as the job's
    processes get it (dualrun/backends/ray/actor_launcher.py)."""
    from dualrun.light.interfaces import holding, ifname_set

    name = holding(node_address) if node_address and not ifname_set(spec["env"]) else None
    if name:
        spec = {**spec, "env": {**spec["env"], "GLOO_SOCKET_IFNAME": name}}
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
            address: str, port: int, model_bytes: int | None = None) -> tuple[list[str], list[str]]:
    """Pure: (problem lines, or the success lines: the group, then each replica's rate). A member that failed on
    its own is the cause: the others' timeouts (they wait for it) are left out; `None` stands for a member stopped
    before it answered (`unanswered`).
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
        return lines, []
    master = results[0] or {}
    rest = "; ".join(f"{m.name} on {at(m.node)}" for m in group.members[1:])
    notes = [f"weight sync: {master.get('backend')} group of {group.world_size} at {address}:{port} (trainer "
             f"rank 0 on {at(group.master.node)}; {rest}) moved a tensor in {float(master.get('seconds', 0)):.2f} s"]
    rates = []
    for m, r in zip(group.members[1:], results[1:]):
        line, rate = rate_line(m, r or {}, at(m.node), str(master.get("backend")))
        notes += [line] if line else []
        rates += [rate] if rate else []
    if rates and model_bytes:
        size = f"{model_bytes / 1e9:.2f} GB" if model_bytes >= 1e9 else f"{model_bytes / 1e6:.1f} MB"
        seconds = model_bytes / min(rates)
        notes.append(f"weight sync: the rollout model's files hold {size}: about "
                     f"{seconds:.{1 if seconds >= 1 else 2}f} s a sync at the slowest replica's "
                     f"{min(rates) / 1e6:.0f} MB/s (weights the trainer holds in a wider dtype than its files move "
                     "more)")
    return [], notes


def rate_line(member: Member, result: Mapping[str, Any], node: str, backend: str) -> tuple[str | None, float | None]:
    """Pure: one member's payload figure, "64 MiB to ... in 0.55 s: 122 MB/s (link eth0: 1000 Mb/s = 125 MB/s)",
    and its rate in bytes/s; (None, None) where it moved no payload. MB = 10^6 bytes."""
    nbytes, seconds = int(result.get("payload_bytes") or 0), float(result.get("payload_s") or 0.0)
    if nbytes <= 0 or seconds <= 0:
        return None, None
    rate = nbytes / seconds
    link = result.get("link")
    if not link:
        said = "its link not found"
    elif link.get("mbps"):
        said = f"link {link['interface']}: {link['mbps']} Mb/s = {link['mbps'] / 8:.0f} MB/s"
    else:
        said = f"link {link['interface']}: no speed reported"
    how = "down the chain" if backend == "gloo" else "broadcast"
    return (f"weight sync: {nbytes / 2**20:.0f} MiB {how} to {member.name} on {node} in {seconds:.2f} s: "
            f"{rate / 1e6:.0f} MB/s ({said})"), rate


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
              timeout_s: float = TIMEOUT_S, model_bytes: int | None = None) -> tuple[list[str], list[str]]:
    """Every member on this machine (torchrun, or a Ray job on an embedded cluster): one child each, stopped at
    the first member that fails on its own."""
    results = run_specs([member_spec(group, m, address, port, timeout_s) for m in group.members])
    return verdict(group, unanswered(results, f"no answer within {limit_s(timeout_s):g} s"), node_names, address,
                   port, model_bytes)
