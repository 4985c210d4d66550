"""`dualrun check --backend slurm`: this machine against the plan (the core's `check_here`: the plan, the
rendezvous port, the weight-sync group), then every node of the allocation asked once through one `srun` step
(a task per node printing `node_facts.facts`) and compared with this machine (versions, the launching directory,
the GPUs the plan puts there)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from dualrun.backends.slurm.allocation import OUTSIDE, current
from dualrun.check.node_facts import NodeReport, Outcome, facts
from dualrun.check.preflight import PROBE_TIMEOUT_S, check_here, compare, plan_or_problem, planned_gpus
from dualrun.config.model import JobConfig
from dualrun.contract.errors import DualrunError

PROBE = ("import json, os, sys\nfrom dualrun.check.node_facts import facts\nf = facts(sys.argv[1])\n"
         "try:\n    import torch\n    f['gpus'] = torch.cuda.device_count()\nexcept Exception:\n    f['gpus'] = 0\n"
         "print('DUALRUN-FACTS ' + os.environ.get('SLURMD_NODENAME', '?') + ' ' + json.dumps(f), flush=True)\n")


def probe_argv(nodes: tuple[str, ...], directory: str) -> list[str]:
    """One task per node, each printing its facts on one line."""
    return ["srun", "--job-name=dualrun-check", f"--nodes={len(nodes)}", f"--ntasks={len(nodes)}",
            "--ntasks-per-node=1", f"--nodelist={','.join(nodes)}", "--overlap", "--export=ALL",
            sys.executable, "-c", PROBE, directory]


def parse_facts(stdout: str) -> dict[str, dict]:
    """node name -> its facts, from the probe's lines."""
    out = {}
    for line in stdout.splitlines():
        if line.startswith("DUALRUN-FACTS "):
            _, name, blob = line.split(" ", 2)
            out[name] = json.loads(blob)
    return out


def check_nodes(cfg: JobConfig) -> Outcome:
    try:
        alloc = current(os.environ)
    except DualrunError as e:
        return [str(e) if str(e) else OUTSIDE], [], []
    problems, here, notes = check_here(cfg)
    nodes = alloc.nodes[:max(1, cfg.num_machines)]
    plan = plan_or_problem(cfg, None, [])
    try:
        done = subprocess.run(probe_argv(nodes, os.getcwd()), capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S + 60)
    except subprocess.TimeoutExpired:
        return problems + [f"the nodes' srun probe did not end within {PROBE_TIMEOUT_S + 60:g} s"], here, notes
    found = parse_facts(done.stdout)
    driver = facts()
    reports = []
    for k, name in enumerate(nodes):
        f = found.get(name)
        if f is None:
            why = (done.stderr.strip().splitlines() or ["no output"])[-1]
            problems.append(f"node {k} {name}: its srun task did not answer ({why})")
            continue
        report = NodeReport(f"node {k} {name}", int(f.pop("gpus", 0)), planned_gpus(plan, k), f)
        problems += compare(driver, report)
        reports.append(report)
    return problems, reports or here, notes
