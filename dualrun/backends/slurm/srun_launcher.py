"""The SLURM launcher: inside an allocation, the trainer ranks as one `srun` step of N tasks and each server as a
step of its own on its node; the core's `Launcher.launch` gives the order, the restarts and the servers' stop.

What it reads: the plan (nodes, devices, env, servers) and the allocation (allocation.py). MASTER_ADDR is the
allocation's first node, MASTER_PORT a port free here (the launcher runs on the first node in an `sbatch` script;
under `salloc` on a login node it is a free port of the login node, tried on the first)."""
from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from typing import Any, Iterator, Mapping

import dualrun.backends.slurm.allocation as allocation
import dualrun.backends.slurm.steps as steps
from dualrun.backends.slurm.srun_servers import SrunServers
from dualrun.backends.slurm.step_process import Step, cancel_steps
from dualrun.backends.slurm.task import DEVICES, ERROR_DIR, MAX_RESTARTS, NODES, RANKS, RESTARTS
from dualrun.contract import protocol
from dualrun.contract.redact import redact, redact_argv
from dualrun.env.worker import TORCHRUN_NAMES
from dualrun.launchers.launcher import (JobResult, Launcher, Outcome, Prepared, bootstrap_cmd,
                                        join_cmd, server_preview_line, stopped_by)
from dualrun.light.ports import free_port
from dualrun.plan.processes import AUTO, Plan
from dualrun.servers.planned import server_previews, started_when
from dualrun.servers.serverset import ServerSet
from dualrun.weightsync.sync_group import group_host_env

POLL_S = 0.25


def slurm_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What srun itself needs of the launcher's env (the job it runs in, the cluster's config): SLURM_*."""
    return {k: v for k, v in environ.items() if k.startswith("SLURM_")}


def given_here(env: dict[str, str]) -> None:
    """A step's srun gets this launcher's own CUDA_VISIBLE_DEVICES (the batch step's GPUs, as SLURM set them), not
    the plan's: the plan's share travels as positions (DEVICES) and each task maps it through what the step was
    given there."""
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]


class Signalled(BaseException):
    """SIGTERM (scancel) or SIGINT reached the launcher: the job's steps are stopped, nothing left."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class SlurmLauncher(Launcher):
    name = "slurm"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._alloc: allocation.Allocation | None = None
        self._port: int | None = None
        self._error_dir: str | None = None

    # -- where ---------------------------------------------------------------------------------------------
    def nodes(self) -> tuple[str, ...]:
        """The allocation's nodes, as many as the job's machines; outside an allocation (a dry run, `plan`) the
        placeholders `<node K>`."""
        n = max(1, self.rdzv.num_machines)
        if allocation.job_id(os.environ) is None:
            return tuple(f"<node {k}>" for k in range(n))
        if self._alloc is None:
            self._alloc = allocation.current(os.environ)
        return self._alloc.nodes[:n]

    def trainer_nodes(self, plan: Plan) -> list[int]:
        return sorted({p.node for p in plan.workers})

    def port(self) -> int:
        if self._port is None:
            self._port = self.rdzv.master_port or free_port("0.0.0.0")
        return self._port

    # -- prepare -------------------------------------------------------------------------------------------
    def rank_env(self, plan: Plan) -> dict[str, str]:
        """What every task of the ranks' step starts with (the shim adds each rank's own): as torchrun's agent."""
        workers = plan.workers
        first = workers[0]
        nodes = self.nodes()
        env = self.worker_env(first.env, MASTER_ADDR=nodes[self.trainer_nodes(plan)[0]], MASTER_PORT=str(self.port()))
        for name in TORCHRUN_NAMES:
            if name in first.env:
                env.pop(name, None)
        env["MASTER_ADDR"], env["MASTER_PORT"] = nodes[self.trainer_nodes(plan)[0]], str(self.port())
        per_node = [next(p for p in workers if p.node == k) for k in self.trainer_nodes(plan)]
        env[DEVICES] = json.dumps([self.positions(plan, p) for p in per_node])
        given_here(env)
        env[RANKS], env[MAX_RESTARTS] = "1", str(self.rdzv.max_failures)
        env[NODES] = ",".join(nodes)
        omp = self.omp_threads(len(workers) // len(per_node))
        if omp is not None:
            env["OMP_NUM_THREADS"] = omp
        env.pop(protocol.LOG_DIR, None)
        if self.rdzv.log_dir:   # each rank also appends its output to log_dir/<role>_<rank>.log
            env[protocol.LOG_DIR] = os.path.abspath(os.path.expanduser(self.rdzv.log_dir))
        return {k: v for k, v in env.items() if v != AUTO}

    @staticmethod
    def positions(plan: Plan, proc: Any) -> str | None:
        """`proc`'s GPUs as positions among its node's (steps.device_positions), what its task narrows to."""
        node = plan.cluster.nodes[proc.node]
        return steps.device_positions(proc.env.get("CUDA_VISIBLE_DEVICES"), node.device_ids or range(node.gpus))

    def prepare(self, plan: Plan | None) -> Prepared:
        assert plan is not None
        nodes = self.nodes()
        trainer_nodes = self.trainer_nodes(plan)
        per_node = len(plan.workers) // len(trainer_nodes)
        argv = steps.ranks_step([nodes[k] for k in trainer_nodes], per_node, bootstrap_cmd(self.program),
                                f"dualrun-train-{self.run_id}")
        bind = "127.0.0.1" if len(nodes) == 1 else "0.0.0.0"
        servers = tuple((label, tuple(steps.server_step(nodes[p.node], cmd, steps.step_name(label, self.run_id))), shown)
                        for p, (label, cmd, shown) in zip(plan.servers, server_previews(plan, bind)))
        return Prepared(plan, tuple(argv), self.rank_env(plan), os.getcwd(), servers=servers)

    def describe(self, prepared: Prepared) -> str:
        alloc = (f"allocation {allocation.job_id(os.environ)}" if allocation.job_id(os.environ)
                 else "outside an allocation: <node K> is the allocation's K-th node")
        lines = [f"# dualrun dry run: backend=slurm, {alloc}; nothing was started", f"cd {join_cmd([prepared.cwd])}"]
        for label, argv, shown in prepared.servers:
            lines.append(f"# {label}, {started_when(prepared.plan, label)}: " + server_preview_line(shown, argv))
        lines.append("# the trainer ranks, one srun task each (the shim sets RANK, LOCAL_RANK, WORLD_SIZE, ... "
                     "from SLURM_PROCID, SLURM_LOCALID, ...):")
        lines.append("env \\")
        lines += [f"  {k}={join_cmd([v])} \\" for k, v in sorted(redact(prepared.env).items())]
        lines.append("  " + join_cmd(redact_argv(prepared.argv)))
        return "\n".join(lines)

    # -- launch --------------------------------------------------------------------------------------------
    def session(self) -> "Any":
        import contextlib

        @contextlib.contextmanager
        def handlers() -> Iterator[None]:
            import threading

            if threading.current_thread() is not threading.main_thread():
                yield
                return

            def raise_it(signum: int, _frame: Any) -> None:
                raise Signalled(signum)

            before = {s: signal.signal(s, raise_it) for s in (signal.SIGTERM, signal.SIGINT)}
            try:
                yield
            finally:
                for s, h in before.items():
                    signal.signal(s, h)
                job = allocation.job_id(os.environ)
                if job:   # a step whose srun had to be killed: SLURM cancels it, nothing left on any node
                    cancel_steps(job, self.run_id)

        return handlers()

    def launch(self, prepared: Prepared) -> JobResult:
        try:
            return super().launch(prepared)
        except Signalled as e:   # while the servers started: they were stopped by Launcher.launch
            return stopped_by(e.signum)

    def server_set(self, plan: Plan | None, attempt: int, avoid: frozenset[str]) -> SrunServers | None:
        assert plan is not None
        if not plan.servers:
            return None

        def env_for(p: Any) -> dict[str, str]:
            env = {**slurm_env(os.environ), **self.worker_env(p.env)}
            env[DEVICES] = json.dumps([self.positions(plan, p)])
            given_here(env)
            env[NODES] = ",".join(self.nodes())
            return env

        return SrunServers(plan, self.nodes(), env_for, lambda addresses: self._wiring(plan, addresses), avoid=avoid,
                           tag=self.run_id)

    def _wiring(self, plan: Plan, addresses: Mapping[str, str]) -> dict[str, str]:
        """The method's wiring of the servers' addresses, and a free weight-sync port (trainer rank 0's)."""
        from dualrun.weightsync.sync_group import port_host

        env = plan.wiring_env(addresses)
        env.update(protocol.group_port_env(plan.weight_sync, free_port(port_host(self.rdzv))))
        return env

    def _step_env(self, prepared: Prepared, attempt: int, servers: ServerSet | None) -> dict[str, str]:
        extra = {protocol.JOB_TOKEN: self.job_token, RESTARTS: str(attempt)}
        if servers is not None:
            extra.update(servers.wiring_env())
            weight_sync = bool(prepared.plan is not None and prepared.plan.weight_sync)
            extra.update(group_host_env(weight_sync, prepared.env, len(self.nodes()) == 1))
        if attempt:
            extra[protocol.JOB_RESTARTS] = str(attempt)
        if self._error_dir is None:
            if self.rdzv.log_dir:   # (the servers, starting beside the ranks, may not have made it yet)
                os.makedirs(self.rdzv.log_dir, exist_ok=True)
            self._error_dir = tempfile.mkdtemp(prefix="dualrun-slurm-errors-", dir=self.rdzv.log_dir or None)
        extra[ERROR_DIR] = self._error_dir
        return {**slurm_env(os.environ), **prepared.env, **extra}

    def run_attempt(self, prepared: Prepared, attempt: int, servers: ServerSet | None) -> Outcome:
        from dualrun.backends.slurm.outcome import ranks_outcome

        start = time.monotonic()
        argv = list(prepared.argv)
        if attempt:   # a fresh step name: the cancelled one may still be listed
            argv[1] = f"--job-name=dualrun-train-{self.run_id}-{attempt}"
        step = Step(argv, self._step_env(prepared, attempt, servers), prepared.cwd)
        if servers is not None:
            servers.watch()
        try:
            while step.poll() is None:
                death = servers.next_death(timeout=POLL_S) if servers is not None else None
                if death is None and servers is None:
                    time.sleep(POLL_S)
                if death is not None:
                    step.stop()
                    servers.unwatch()
                    result = JobResult(1, wall_time_s=time.monotonic() - start, message=str(death))
                    return Outcome(result, f"{death.one_line()}; restarting the job with fresh servers", (death,))
        except Signalled as e:
            step.stop()
            return Outcome(stopped_by(e.signum, wall_time_s=time.monotonic() - start))
        finally:
            if servers is not None:
                servers.unwatch()
        step.wait_output()
        return ranks_outcome(step, prepared.plan, self._error_dir or "", time.monotonic() - start,
                             attempt < self.rdzv.max_failures)
