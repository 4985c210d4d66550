"""`dualrun check` on Ray: every node of the cluster asked once (a zero-CPU task pinned to it, under the config's
runtime_env) and compared with the driver, then the weight-sync group formed on the nodes the plan gives it
(dualrun/check/preflight.py has the table and the comparisons)."""
from __future__ import annotations

import os
import time
from typing import Any

from dualrun.plan.meeting import rendezvous_of
from dualrun.check.node_facts import NodeReport, Outcome, facts
from dualrun.check.preflight import (PROBE_TIMEOUT_S, check_here, compare, model_file_bytes, plan_or_problem,
                                     planned_gpus, rank0_ports)
from dualrun.config.model import JobConfig
from dualrun.contract.errors import DualrunError
from dualrun.weightsync.sync_group import SyncGroup, node_host_env, port_host, sync_group
from dualrun.weightsync.rehearsal import is_hard, limit_s, master_endpoint, member_spec, run_member, unanswered, verdict


def _directory(cfg: JobConfig) -> str | None:
    """The directory every node must have: the launching one, unless runtime_env.working_dir ships it."""
    return None if cfg.ray.runtime_env.get("working_dir") else os.getcwd()


def check_ray(cfg: JobConfig) -> Outcome:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from dualrun.backends.ray.cluster import alive_nodes, cluster_of, connect, resolve_address

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
        return check_here(cfg)
    if conn is None:
        return [f"ray.address: could not connect to the Ray cluster at {address}"], [], []
    try:
        raw = alive_nodes()
        cluster = cluster_of(raw)
        plan = plan_or_problem(cfg, cluster, problems)
        gcs = ray.get_runtime_context().gcs_address
        host, _, port = gcs.rpartition(":")
        probe = ray.remote(num_cpus=0, max_retries=0)(facts)
        fixed = rank0_ports(cfg, plan)
        refs = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                .remote(_directory(cfg), [(host, int(port))], list(fixed.get(i, {}))) for i, n in enumerate(raw)]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=PROBE_TIMEOUT_S)
        driver = facts()
        nodes = []
        names = {i: f"node {i} {n.get('NodeManagerAddress', '?')}" for i, n in enumerate(raw)}
        for i, (n, ref) in enumerate(zip(raw, refs)):
            name = names[i]
            if ref not in ready:
                problems.append(f"{name}: did not answer within {PROBE_TIMEOUT_S:g} s (a runtime_env that does "
                                "not install there, or no free worker process)")
                continue
            try:
                report = NodeReport(name, cluster.nodes[i].gpus, planned_gpus(plan, i), ray.get(ref),
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
    ref = endpoint.options(**on(group.master.node)).remote(port_host(rendezvous_of(cfg)), master_env)
    ready, _ = ray.wait([ref], timeout=PROBE_TIMEOUT_S)
    if not ready:
        return [f"weight sync: {names[group.master.node]}: trainer rank 0's node did not pick a port within "
                f"{PROBE_TIMEOUT_S:g} s"], []
    address, port = ray.get(ref)
    task = ray.remote(num_cpus=0, max_retries=0)(run_member)
    refs = [task.options(**on(m.node, len(m.ranks) if group.gpus else 0)).remote(
        member_spec(group, m, address, port), addresses[m.node] if addresses else None) for m in group.members]
    results: list[dict[str, Any] | None] = [None] * len(refs)
    deadline = time.monotonic() + limit_s() + PROBE_TIMEOUT_S
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
    return verdict(group, unanswered(results, f"its task did not end within {limit_s() + PROBE_TIMEOUT_S:g} s "
                                              "(the node busy, or its GPUs taken)"), names, address, port,
                   model_file_bytes(cfg, group.role))
