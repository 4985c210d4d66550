"""`dualrun check --config_file F`: find what would make a job hang or fail before starting it.

Why: on Ray the usual causes of a hang are nodes that differ from the driver (another torch or TRL, the
launching directory missing), a plan the nodes cannot hold, or nodes that cannot reach the head. We ask every
node once (a zero-CPU task pinned to it, under the config's runtime_env), compare with the driver, and print
one line per problem (exit 1) or a table of the nodes (exit 0). On torchrun the same for this machine: the
packages, its GPUs against the plan, the ports the plan binds here, and the route to the master address.
Where the job syncs weights to separate rollout engines, the trainer's weight-sync group is then formed on the
nodes the plan gives it and one tensor moved through it (dualrun.weightsync.rehearsal), before any model loads.

Ports: servers and rank 0 take free ports, so the plan fixes a port only where the config does: rank 0's
`main_process_port` (on torchrun 29500 when several machines rendezvous), on machine 0 (torchrun) or on the node
the plan puts rank 0 (Ray; its placement group decides the final node). A server's port is never fixed: a
`--port` in `server_args` is a config error (dualrun.methods.commands.validate_server_role).
"""
from __future__ import annotations

import os
from typing import Any, Callable

from dualrun.plan.meeting import rendezvous_of
from dualrun.config.model import JobConfig
from dualrun.contract.errors import DualrunError
from dualrun.methods.plugin import get_plugin
from dualrun.check.node_facts import CHECKED_PACKAGES, NodeReport, Outcome, can_bind, facts, version_differences
from dualrun.launchers.rendezvous_port import TORCHRUN_STORE, store_host
from dualrun.plan.processes import Cluster, Plan, make_plan
from dualrun.weightsync.sync_group import port_host, sync_group
from dualrun.weightsync.rehearsal import master_endpoint, run_local

PROBE_TIMEOUT_S = 60.0   # a node's answer to the check


def compare(driver: dict[str, Any], node: NodeReport) -> list[str]:
    """Pure: every way `node` differs from the driver or cannot serve the plan, one phrase each."""
    f = node.facts
    out = version_differences(driver, f)
    if not f["directory_ok"]:
        out.append(f"the launching directory {f['directory']} does not exist there (use a shared filesystem or "
                   "ray.runtime_env: {working_dir: .})")
    if node.planned_gpus > node.gpus:
        out.append(f"the plan puts {node.planned_gpus} GPU(s) there, it has {node.gpus}")
    for address, why in f["reach"].items():
        if why:
            out.append(f"cannot reach {address} ({why})")
    for port, who in sorted(node.ports.items()):
        why = f.get("ports", {}).get(port)
        if why:
            out.append(f"port {port} ({who}) is not free there ({why})")
    return [f"{node.name}: {p}" for p in out]


def rank0_ports(cfg: JobConfig, plan: Plan | None) -> dict[int, dict[int, str]]:
    """Pure, Ray: node index -> {port: who} for `main_process_port`, which rank 0 binds as MASTER_PORT there."""
    port = cfg.main_process_port
    rank0 = next((p for p in plan.workers if p.rank == 0), None) if plan else None
    if port is None or rank0 is None:
        return {}
    return {rank0.node: {port: f"{rank0.label}: main_process_port"}}


def table(nodes: list[NodeReport]) -> str:
    head = ["node", "gpus (plan/has)", "python", *CHECKED_PACKAGES, "directory", "reach", "ports"]
    rows = [head]
    for n in nodes:
        f = n.facts
        rows.append([n.name, f"{n.planned_gpus}/{n.gpus}", f["python"],
                     *[f["versions"].get(p) or "-" for p in CHECKED_PACKAGES],
                     "ok" if f["directory_ok"] else "missing",
                     ", ".join(f["reach"]) + " ok" if f["reach"] else "-",
                     ", ".join(map(str, sorted(n.ports))) + " free" if n.ports else "-"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def planned_gpus(plan: Plan | None, node: int) -> int:
    return sum(len(p.devices) for p in plan.on_node(node)) if plan else 0


def plan_or_problem(cfg: JobConfig, cluster: Cluster | None, problems: list[str]) -> Plan | None:
    """The plan, or None with its error among `problems` (the check goes on without it)."""
    try:
        return make_plan(cfg, cluster, environ=os.environ, method=get_plugin(cfg.method, cfg.source))
    except DualrunError as e:
        problems.append(f"plan: {e}")
        return None


def this_machine(cfg: JobConfig, plan: Plan | None, problems: list[str]) -> tuple[NodeReport, dict[str, Any]]:
    """This machine (machine_rank) against the plan: its packages and its GPUs; (its report, its facts)."""
    here = facts(os.getcwd())
    for name in CHECKED_PACKAGES:
        if here["versions"][name] is None:
            problems.append(f"this machine: {name} is not installed")
    gpus = 0 if cfg.use_cpu else _local_gpus()
    node = NodeReport(f"node {cfg.machine_rank} (this machine)", gpus, planned_gpus(plan, cfg.machine_rank), here)
    problems += compare(here, node)
    return node, here


def check_here(cfg: JobConfig) -> Outcome:
    """A job of this machine alone (one torchrun machine, an embedded Ray cluster): this machine against the
    plan, the rendezvous port, and the weight-sync group formed here."""
    problems: list[str] = []
    plan = plan_or_problem(cfg, None, problems)
    node, here = this_machine(cfg, plan, problems)
    master = cfg.main_process_ip or "127.0.0.1"
    why = can_bind(master, 0) if cfg.main_process_ip else None
    if why:
        problems.append(f"main_process_ip: {master} is not an address of this machine ({why})")
    if cfg.main_process_port:   # as the launch refuses it (dualrun.launchers.rendezvous_port), where the store binds
        why = can_bind(store_host(True, master), cfg.main_process_port)
        if why:
            problems.append(f"main_process_port: {cfg.main_process_port} is taken on this machine ({why}): "
                            f"{TORCHRUN_STORE} listens on it")
    group = sync_group(cfg, plan) if plan else None
    notes: list[str] = []
    if group is not None and here["versions"]["torch"]:
        address, port = master_endpoint(port_host(rendezvous_of(cfg)), group.master.env)
        found, said = run_local(group, address, port, {0: node.name}, model_bytes=model_file_bytes(cfg, group.role))
        problems += found
        notes += said
    return problems, [node], notes


def model_file_bytes(cfg: JobConfig, role_name: str) -> int | None:
    """The bytes of the weight files of the model of `role_name` (the role whose engines take the weights:
    `SyncGroup.role`) where its `model` is a directory here (safetensors, else PyTorch's .bin), for the check's
    estimate of a sync's time; None otherwise (a hub name, nothing found)."""
    role = cfg.role(role_name)
    path = role.model if role is not None else None
    if not path or not os.path.isdir(path):
        return None
    for suffix in (".safetensors", ".bin"):
        sizes = [os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(suffix)]
        if sizes:
            return sum(sizes)
    return None


def _local_gpus() -> int:
    from dualrun.config.starter import detected_devices

    return detected_devices()[0]


def range_notes(nodes: list[NodeReport]) -> list[str]:
    """Pure: each node's versions outside the ranges TRL and vLLM declare for each other (and transformers), one
    line each. Notes, not problems: TRL only warns about an untested vLLM, and the job may well run."""
    return [f"{n.name}: {phrase}" for n in nodes for phrase in n.facts.get("ranges", [])]


def run_check(cfg: JobConfig, nodes_of: Callable[[JobConfig], Outcome]) -> int:
    """Print the problems (one line each; exit code 1) or the table of nodes (exit code 0); version ranges that
    TRL or vLLM declare and this install is outside of are named as notes either way. `nodes_of`: the backend's
    look at its nodes (`Backend.check`)."""
    problems, nodes, notes = nodes_of(cfg)
    for note in range_notes(nodes):
        print(f"dualrun check: note: {note}")
    if problems:
        for p in problems:
            print(f"dualrun check: {p}")
        return 1
    print(table(nodes))
    for note in notes:
        print(f"dualrun check: {note}")
    print(f"dualrun check: {len(nodes)} node(s) ready for backend={cfg.backend}")
    return 0
