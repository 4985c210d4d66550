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
import time
from typing import Any, Callable

from dualrun.config.model import JobConfig
from dualrun.contract.errors import DualrunError
from dualrun.check.node_facts import CHECKED_PACKAGES, NodeReport, Outcome, can_bind, facts, version_differences
from dualrun.launchers.rendezvous_port import TORCHRUN_STORE, store_host
from dualrun.plan.processes import Cluster, Plan, make_plan
from dualrun.weightsync.group import SyncGroup, node_host_env, port_host, sync_group
from dualrun.weightsync.rehearsal import (is_hard, limit_s, master_endpoint, member_spec, run_local, run_member,
                                          unanswered, verdict)

_PROBE_TIMEOUT_S = 60.0


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


def _planned_gpus(plan: Plan | None, node: int) -> int:
    return sum(len(p.devices) for p in plan.on_node(node)) if plan else 0


def _plan(cfg: JobConfig, cluster: Cluster | None, problems: list[str]) -> Plan | None:
    try:
        return make_plan(cfg, cluster, environ=os.environ)
    except DualrunError as e:
        problems.append(f"plan: {e}")
        return None


def _directory(cfg: JobConfig) -> str | None:
    """The directory every node must have: the launching one, unless runtime_env.working_dir ships it."""
    return None if cfg.ray.runtime_env.get("working_dir") else os.getcwd()




def check_ray(cfg: JobConfig) -> Outcome:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from dualrun.raycluster import alive_nodes, cluster_of, connect, resolve_address

    problems: list[str] = []
    working_dir = cfg.ray.runtime_env.get("working_dir")
    if working_dir and "://" not in str(working_dir) and not os.path.isdir(str(working_dir)):
        return [f"ray.runtime_env.working_dir: {working_dir} does not exist on the driver"], [], []
    try:
        address = resolve_address(cfg.ray.address, cfg.source)
        conn = None if address is None else connect(cfg.ray, cfg.source, allow_start=False)
    except DualrunError as e:
        return [str(e)], [], []
    if address is None:   # `dualrun launch` would start an embedded cluster: this machine alone
        return check_torchrun(cfg)
    if conn is None:
        return [f"ray.address: could not connect to the Ray cluster at {address}"], [], []
    try:
        raw = alive_nodes()
        cluster = cluster_of(raw)
        plan = _plan(cfg, cluster, problems)
        gcs = ray.get_runtime_context().gcs_address
        host, _, port = gcs.rpartition(":")
        probe = ray.remote(num_cpus=0, max_retries=0)(facts)
        fixed = rank0_ports(cfg, plan)
        refs = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                .remote(_directory(cfg), [(host, int(port))], list(fixed.get(i, {}))) for i, n in enumerate(raw)]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=_PROBE_TIMEOUT_S)
        driver = facts()
        nodes = []
        names = {i: f"node {i} {n.get('NodeManagerAddress', '?')}" for i, n in enumerate(raw)}
        for i, (n, ref) in enumerate(zip(raw, refs)):
            name = names[i]
            if ref not in ready:
                problems.append(f"{name}: did not answer within {_PROBE_TIMEOUT_S:g} s (a runtime_env that does "
                                "not install there, or no free worker process)")
                continue
            try:
                report = NodeReport(name, cluster.nodes[i].gpus, _planned_gpus(plan, i), ray.get(ref),
                                    ports=fixed.get(i, {}))
            except Exception as e:  # noqa: BLE001 - a node that cannot run the probe is a problem of its own
                problems.append(f"{name}: the check failed there: {str(e).strip().splitlines()[-1]}")
                continue
            problems += compare(driver, report)
            nodes.append(report)
        group = sync_group(cfg, plan) if plan else None
        notes: list[str] = []
        if group is not None and all(m.node in ready_nodes(refs, ready) for m in group.members):
            found, said = handshake_ray(cfg, group, [n["NodeID"] for n in raw], names,
                                        [n.get("NodeManagerAddress") for n in raw] if cluster.addresses() > 1 else None)
            problems += found
            notes += said
        return problems, nodes, notes
    finally:
        conn.close()


def ready_nodes(refs: list[Any], ready: list[Any]) -> set[int]:
    return {i for i, ref in enumerate(refs) if ref in ready}


def handshake_ray(cfg: JobConfig, group: SyncGroup, node_ids: list[str], names: dict[int, str],
                  addresses: list[str | None] | None = None) -> tuple[list[str], list[str]]:
    """The weight-sync group on the Ray nodes the plan gives its members: a port picked on trainer rank 0's node,
    then one task per member on its node (with the member's GPUs where NCCL may run), stopped at the first that
    fails on its own, all within the probe's limit. `addresses` (several nodes): each node's Ray address, whose
    interface a member's gloo gets and trainer rank 0 advertises, as the job's do."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    def on(node: int, num_gpus: float = 0) -> dict[str, Any]:
        return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_ids[node], soft=False),
                "num_gpus": num_gpus}

    endpoint = ray.remote(num_cpus=0, max_retries=0)(master_endpoint)
    master_env = {**group.master.env,   # its node's address, as the job's trainer rank 0 advertises it
                  **node_host_env(group.master.env, addresses[group.master.node] if addresses else None)}
    ref = endpoint.options(**on(group.master.node)).remote(port_host(cfg), master_env)
    ready, _ = ray.wait([ref], timeout=_PROBE_TIMEOUT_S)
    if not ready:
        return [f"weight sync: {names[group.master.node]}: trainer rank 0's node did not pick a port within "
                f"{_PROBE_TIMEOUT_S:g} s"], []
    address, port = ray.get(ref)
    task = ray.remote(num_cpus=0, max_retries=0)(run_member)
    refs = [task.options(**on(m.node, len(m.ranks) if group.gpus else 0)).remote(
        member_spec(group, m, address, port), addresses[m.node] if addresses else None) for m in group.members]
    results: list[dict[str, Any] | None] = [None] * len(refs)
    deadline = time.monotonic() + limit_s() + _PROBE_TIMEOUT_S
    pending = list(refs)
    while pending and time.monotonic() < deadline and not any(is_hard(r) for r in results):
        done, pending = ray.wait(pending, timeout=min(1.0, max(0.0, deadline - time.monotonic())))
        for r in done:
            try:
                results[refs.index(r)] = ray.get(r)
            except Exception as e:  # noqa: BLE001 - a node that cannot run the probe is a member's failure
                results[refs.index(r)] = {"ok": False, "error": str(e).strip().splitlines()[-1]}
    for r in pending:
        ray.cancel(r, force=True)
    return verdict(group, unanswered(results, f"its task did not end within {limit_s() + _PROBE_TIMEOUT_S:g} s "
                                              "(the node busy, or its GPUs taken)"), names, address, port,
                   model_file_bytes(cfg))


def check_torchrun(cfg: JobConfig, wait_s: float | None = None) -> Outcome:
    """This machine (machine_rank) against the plan; on several machines, then the meeting with the others
    (dualrun.check.machines), else the rendezvous port and the weight-sync group here."""
    problems: list[str] = []
    plan = _plan(cfg, None, problems)
    here = facts(os.getcwd())
    for name in CHECKED_PACKAGES:
        if here["versions"][name] is None:
            problems.append(f"this machine: {name} is not installed")
    gpus = 0 if cfg.use_cpu else _local_gpus()
    node = NodeReport(f"node {cfg.machine_rank} (this machine)", gpus, _planned_gpus(plan, cfg.machine_rank), here)
    problems += compare(here, node)
    if cfg.num_machines > 1:
        from dualrun.check.meeting import meet
        from dualrun.check.machines import WAIT_S

        return meet(cfg, plan, node, problems, WAIT_S if wait_s is None else wait_s)
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
        address, port = master_endpoint(port_host(cfg), group.master.env)
        found, said = run_local(group, address, port, {0: node.name}, model_bytes=model_file_bytes(cfg))
        problems += found
        notes += said
    return problems, [node], notes


def model_file_bytes(cfg: JobConfig) -> int | None:
    """The bytes of the rollout model's weight files where its `model` is a directory here (safetensors, else
    PyTorch's .bin), for the check's estimate of a sync's time; None otherwise (a hub name, nothing found)."""
    role = cfg.role("rollout")
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
    look at its nodes (`check_torchrun`, `check_ray`)."""
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
