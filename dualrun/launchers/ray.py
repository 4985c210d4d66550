"""Ray backend: one placement group per unit, one actor per rank, the user's program in a fresh interpreter.

Why this shape: each actor holds exactly its bundle (one GPU, so LOCAL_RANK=0 and CUDA_VISIBLE_DEVICES is the
GPU Ray gave it) and runs `python -m dualrun.bootstrap` as a subprocess in the launching directory with an env
built here on the driver from the driver's allow-listed env, so a script sees the same variable names as under
torchrun. Rank 0's actor picks MASTER_ADDR (its node) and a free port before any program starts (two-phase start).
The driver waits on Ray refs (no sleep polling), prints every line with a `[train rank N]` prefix, and on any
failure or signal stops all ranks and removes actors and placement groups.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from dualrun.envspec import forwarded_env, redact
from dualrun.errors import LaunchError
from dualrun.interpreter import PYTHON
from dualrun.launchers.base import JobResult, Launcher, RankResult, bootstrap_cmd, join_cmd, report_servers
from dualrun.launchers.ray_results import failure, first_line, value
from dualrun.plan import AUTO, Cluster, Plan, Process
from dualrun.servers.wiring import group_port_env

_STOP_GRACE_S = 3.0     # SIGTERM -> SIGKILL for a worker's process group
_SHUTDOWN_S = 8.0       # stop + drain budget (a driver signal must end the job within 10 s)


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class _Rank:
    proc: Process
    actor: Any
    info: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    result: dict[str, Any] | None = None


class RayLauncher(Launcher):
    name = "ray"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._conn = None
        self._signal: int | None = None
        self._stop_time: float | None = None
        self._servers: Any = None
        self._wiring: dict[str, str] = {}
        self._server_failure: str | None = None   # why the last attempt ended, when a server died

    # -- cluster -------------------------------------------------------------------------------------------------
    def cluster(self) -> Cluster | None:
        """Connect (or start the embedded cluster) and return its live nodes for the plan."""
        from dualrun.launchers import ray_cluster

        if self._conn is None:
            self._conn = ray_cluster.connect(self.cfg, allow_start=True)
        return ray_cluster.cluster_of(ray_cluster.alive_nodes())

    def close(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            conn.close()

    # -- env -----------------------------------------------------------------------------------------------------
    def bundle(self, p: Process) -> dict[str, float]:
        cpus = self.cfg.ray.num_cpus_per_worker
        if p.kind == "server":
            return {"GPU": float(len(p.devices))} if p.devices else {"CPU": max(cpus, 1.0)}
        out = {"CPU": float(cpus)} if cpus else {}
        if p.devices:
            out["GPU"] = 1.0
        return out or {"CPU": 0.001}

    def _omp(self, plan: Plan) -> str | None:
        """torchrun's rule: the launching env's value, else 1 when a node runs more than one process."""
        if "OMP_NUM_THREADS" in os.environ:
            return os.environ["OMP_NUM_THREADS"]
        per_node = len(plan.workers) // max(1, self.cfg.num_machines)
        return "1" if per_node > 1 else None

    def rank_env(self, plan: Plan, p: Process, base: Mapping[str, str], *, master_addr: str = AUTO,
                 master_port: str = AUTO, gpus: str | None = None, node_rank: int | None = None,
                 num_nodes: int | None = None, error_file: str = AUTO, restart: int = 0) -> dict[str, str]:
        """The exact env of one rank's program (`<auto>` where only the launch knows the value)."""
        env = self.worker_env(p.env, base=base, MASTER_ADDR=master_addr, MASTER_PORT=master_port)
        env["MASTER_ADDR"], env["MASTER_PORT"] = master_addr, str(master_port)
        env["TORCHELASTIC_RUN_ID"] = self.run_id
        env["CUDA_VISIBLE_DEVICES"] = AUTO if gpus is None and p.devices else (gpus or "")
        if node_rank is not None:
            env["NODE_RANK"] = env["GROUP_RANK"] = str(node_rank)
        if num_nodes is not None:
            env["GROUP_WORLD_SIZE"] = str(num_nodes)
        env["TORCHELASTIC_USE_AGENT_STORE"] = "False"   # rank 0 hosts the TCPStore itself
        env["TORCHELASTIC_ERROR_FILE"] = error_file
        env["TORCHELASTIC_RESTART_COUNT"] = str(restart)
        omp = self._omp(plan)
        if omp is None:
            env.pop("OMP_NUM_THREADS", None)
        else:
            env["OMP_NUM_THREADS"] = omp
        return env

    def describe(self, plan: Plan) -> str:
        """The plan's ranks, their bundles and env (redacted); connects to nothing."""
        base = forwarded_env()
        envs = [redact(self.rank_env(plan, p, base)) for p in plan.workers]
        shared = {k: v for k, v in envs[0].items() if all(e.get(k) == v for e in envs)} if envs else {}
        addr = self.cfg.ray.address or "a running cluster if reachable, else an embedded local one"
        lines = [f"# dualrun dry run: backend=ray, cluster {addr}; nothing was started",
                 f"# placement: one placement group per unit, strategy {self.cfg.ray.placement_strategy}, "
                 f"timeout {self.cfg.ray.placement_timeout_s:g} s; one actor per rank",
                 f"# every worker runs, in {os.getcwd()}:",
                 "#   " + join_cmd(bootstrap_cmd(self.program, PYTHON)),
                 "# env shared by every worker:"]
        lines += [f"  {k}={join_cmd([v])}" for k, v in sorted(shared.items())]
        for p, env in zip(plan.workers, envs):
            own = {k: v for k, v in env.items() if k not in shared}
            lines.append(f"# {p.label}: bundle {self.bundle(p)}, planned node {p.node}")
            lines += [f"  {k}={join_cmd([v])}" for k, v in sorted(own.items())]
        for p in plan.servers:
            lines.append(f"# {p.label}: bundle {self.bundle(p)}, started (and healthy) before the trainers")
        return "\n".join(lines)

    # -- launch --------------------------------------------------------------------------------------------------
    def launch(self, plan: Plan) -> JobResult:
        """Run the job; on failure restart the whole job up to max_failures times (torchrun's semantics). Servers
        stay up across restarts of the trainers; a server that died is replaced by a fresh one on a fresh port."""
        start = time.monotonic()
        if self._conn is None:
            self.cluster()
        restore = self._trap_signals()
        attempt, used = 0, set()
        try:
            while True:
                if self._servers is None:
                    try:
                        self.start_servers(plan, attempt, used)
                    except LaunchError as e:
                        result = JobResult(e.exit_code, message=str(e))
                        break
                    except _Interrupted as e:
                        result = JobResult(128 + e.signum, message=f"stopped by {e}: every server was stopped")
                        break
                result = self._attempt(plan, attempt)
                if result.ok or result.exit_code in (130, 143) or attempt >= self.cfg.max_failures:
                    break
                attempt += 1
                if self._server_failure is not None:   # fresh servers; never the dead one's address
                    used |= self._servers.used()
                    self._servers.stop(grace_s=_STOP_GRACE_S)
                    self._servers = None
                first = (result.message or "").splitlines()[0] if result.message else "the job failed"
                print(f"dualrun: {first}; restarting the job ({attempt}/{self.cfg.max_failures})",
                      file=sys.stderr, flush=True)
        finally:
            if self._servers is not None:   # servers go with the job
                self._servers.stop(grace_s=_STOP_GRACE_S if self._signal is not None else 10.0)
                self._servers = None
            restore()
        result.restarts = attempt
        result.wall_time_s = time.monotonic() - start
        return result

    def start_servers(self, plan: Plan, attempt: int = 0, avoid: "set[str] | frozenset[str]" = frozenset()) -> None:
        """Separate roles: each server in its own placement group and actor, healthy before any trainer starts;
        the trainers get the plugin's wiring of their addresses (also for user-run servers, `address:`).
        Signals are seen while Ray places and starts them."""
        from dualrun.servers.ray_server import RayServers

        self._servers = RayServers(self.cfg, self.plugin, plan, self.run_id,
                                   env_for=lambda p: self.worker_env(p.env, base=forwarded_env()), bundle=self.bundle,
                                   check=self._check_signal, attempt=attempt, avoid=avoid)
        try:
            self._servers.start()
        except BaseException:
            self._servers = None   # start() stopped what it had started
            raise
        report_servers(self._servers.addresses, plan.external)
        self._wiring = self._servers.wiring_env()

    def _trap_signals(self):
        """SIGTERM/SIGINT only set a flag, checked between Ray calls (at most 1 s apart): raising inside a Ray
        call from a handler breaks it (SystemError), and Ray's own driver handler would just sys.exit."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def handler(signum: int, frame: Any) -> None:
            if self._signal is None:     # a second Ctrl-C must not change the outcome or cut the cleanup short
                self._signal = signum

        old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
        return lambda: [signal.signal(s, h) for s, h in old.items()]

    def _check_signal(self) -> None:
        if self._signal is not None:
            raise _Interrupted(self._signal)

    def _attempt(self, plan: Plan, attempt: int) -> JobResult:
        from ray.exceptions import RayError
        from ray.util.placement_group import remove_placement_group

        from dualrun.launchers import ray_cluster

        self._stop_time = None
        self._server_failure = None

        pgs: list[Any] = []
        ranks: list[_Rank] = []
        try:
            try:
                by_unit: dict[str, list[Process]] = {}
                for p in plan.workers:
                    by_unit.setdefault(p.unit, []).append(p)
                for unit, procs in by_unit.items():
                    bundles = [self.bundle(p) for p in procs]
                    role = procs[0].roles[0]
                    ray_cluster.check_resources(self.cfg, role, bundles)
                    pg = ray_cluster.placement_group(self.cfg, f"{self.run_id}-{unit}-{attempt}", bundles)
                    pgs.append(pg)
                    ray_cluster.wait_placed(self.cfg, pg, role, bundles, self._check_signal)
                    ranks += self._actors(pg, procs, attempt)
                self._start(plan, ranks, attempt)
                return self._supervise(ranks)
            except RayError as e:
                raise LaunchError(f"the Ray workers could not start: {first_line(e)}", 1) from None
            except _Interrupted as e:
                code = 128 + e.signum
                self._stop_all(ranks)
                return JobResult(code, message=f"stopped by {e}: every worker of the job was terminated")
        finally:
            self._remove(ranks, pgs, remove_placement_group)

    def _actors(self, pg: Any, procs: list[Process], attempt: int) -> list[_Rank]:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from dualrun.launchers.ray_worker import RankWorker

        cls = ray.remote(RankWorker)
        out = []
        for i, p in enumerate(procs):   # rank order: rank 0's actor is created first
            b = self.bundle(p)
            opts: dict[str, Any] = {
                "num_cpus": b.get("CPU", 0), "num_gpus": b.get("GPU", 0), "max_concurrency": 4, "max_restarts": 0,
                "name": f"{self.run_id}-{p.unit}-{p.rank}-{attempt}",
                "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)}
            out.append(_Rank(p, cls.options(**opts).remote(self.run_id, p.label)))
        return out

    def _start(self, plan: Plan, ranks: list[_Rank], attempt: int) -> None:
        """Phase 1: where did each actor land (rank 0 picks the port); phase 2: start every program."""
        infos = self._get([r.actor.info.remote(r.proc.rank == 0) for r in ranks], "start their actors")
        for r, info in zip(ranks, infos):
            r.info = info
        master = next(r for r in ranks if r.proc.rank == 0).info
        nodes = len({r.info["node_id"] for r in ranks})
        units = sorted({r.proc.unit for r in ranks})
        print(f"dualrun: {', '.join(units)}: {len(ranks)} worker(s) placed on {nodes} node(s), master "
              f"{master['ip']}:{master['port']}; starting the program", file=sys.stderr, flush=True)
        order: list[str] = []
        for r in ranks:
            if r.info["node_id"] not in order:
                order.append(r.info["node_id"])
        base = forwarded_env()
        argv = bootstrap_cmd(self.program, PYTHON)
        call = None
        if self.program.call_file:   # Python API: the pickled call travels to each node through its actor
            from dualrun.launchers.ray_worker import CALL

            with open(self.program.call_file, "rb") as f:
                call = f.read()
            argv = bootstrap_cmd(replace(self.program, call_file=CALL), PYTHON)
        log_dir = self.cfg.log_dir
        refs = []
        for r in ranks:
            err = os.path.join(r.info["tmp"], f"attempt_{attempt}", str(r.proc.rank), "error.json")
            r.env = self.rank_env(plan, r.proc, base, master_addr=master["ip"], master_port=str(master["port"]),
                                  gpus=",".join(r.info["gpus"]), node_rank=order.index(r.info["node_id"]),
                                  num_nodes=len(order), error_file=err, restart=attempt)
            r.env.update(self._wiring)
            r.env.update(group_port_env(self._wiring, master.get("group_port")))
            log = os.path.abspath(os.path.join(log_dir, f"{r.proc.unit}_{r.proc.rank}.log")) if log_dir else None
            refs.append(r.actor.start.remote(argv, r.env, os.getcwd(), log, call))
        self._get(refs, "start the program")

    def _get(self, refs: list[Any], what: str) -> list[Any]:
        from dualrun.launchers.ray_cluster import wait_refs

        return wait_refs(refs, what, max(60.0, self.cfg.ray.placement_timeout_s), self._check_signal)

    def _supervise(self, ranks: list[_Rank]) -> JobResult:
        """Wait on exits and output; the first failure (or a dead actor) stops every rank."""
        import ray
        from ray.exceptions import RayActorError

        pending: dict[Any, tuple[str, int]] = {}
        for i, r in enumerate(ranks):
            pending[r.actor.wait.remote()] = ("exit", i)
            pending[r.actor.lines.remote()] = ("out", i)
        watch = dict(self._servers.watch) if self._servers is not None else {}   # a server that ends
        failed: list[int] = []
        deadline = None
        while pending:
            timeout = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
            ready, _ = ray.wait(list(pending) + list(watch), num_returns=1, timeout=timeout)
            if deadline is None:
                self._check_signal()
            if deadline is not None and time.monotonic() >= deadline and not ready:
                break
            for ref in ready:
                if ref in watch:
                    watch.pop(ref)
                    self._server_failure = self._server_failure or self._servers.why_ended(ref)
                    if deadline is None:
                        self._stop_all(ranks, wait=False)
                        deadline = time.monotonic() + _SHUTDOWN_S
                    continue
                kind, i = pending.pop(ref)
                r = ranks[i]
                if kind == "out":
                    try:
                        batch = ray.get(ref)
                    except RayActorError:
                        continue
                    if batch is not None:
                        self._print(r, batch)
                        pending[r.actor.lines.remote()] = ("out", i)
                    continue
                try:
                    r.result = ray.get(ref)
                except RayActorError as e:
                    r.result = {"exit_code": 1, "end": time.time(), "error": f"its Ray actor died ({first_line(e)})"}
                if r.result["exit_code"] != 0 and not failed:
                    failed.append(i)
                    self._stop_all(ranks, wait=False)
                    deadline = time.monotonic() + _SHUTDOWN_S
        if failed and watch and self._server_failure is None:   # did the ranks fail because a server died?
            done, _ = ray.wait(list(watch), num_returns=1, timeout=0.5)
            for ref in done:
                self._server_failure = self._servers.why_ended(ref)
        results = [RankResult(r.proc.label, r.proc.rank, r.result["exit_code"] if r.result else -15,
                              r.result.get("error") if r.result else None) for r in ranks]
        if self._server_failure is not None:
            return JobResult(1, results, message=self._server_failure)
        if not failed:
            return JobResult(0, [RankResult(r.proc.label, r.proc.rank, 0, result=value(r.result)) for r in ranks])
        return failure(ranks, failed[0], self._stop_time)

    def _print(self, r: _Rank, batch: list[tuple[int, str]]) -> None:
        prefix = f"[{r.proc.label}] "
        out = [prefix + t for s, t in batch if s == 1]
        err = [prefix + t for s, t in batch if s != 1]
        if out:
            sys.stdout.write("\n".join(out) + "\n")
            sys.stdout.flush()
        if err:
            sys.stderr.write("\n".join(err) + "\n")
            sys.stderr.flush()

    def _stop_all(self, ranks: list[_Rank], wait: bool = True) -> None:
        import ray

        if self._stop_time is None:
            self._stop_time = time.time()
        refs = []
        for r in ranks:
            try:
                refs.append(r.actor.stop.remote(_STOP_GRACE_S))
            except Exception:  # noqa: BLE001 - an actor already gone needs no stopping
                pass
        if wait and refs:
            ray.wait(refs, num_returns=len(refs), timeout=_SHUTDOWN_S)

    def _remove(self, ranks: list[_Rank], pgs: list[Any], remove_pg: Any) -> None:
        """Every program stopped, every actor killed, every placement group removed; nothing left behind."""
        import ray

        self._stop_all(ranks)
        refs = []
        for r in ranks:
            try:
                refs.append(r.actor.cleanup.remote())
            except Exception:  # noqa: BLE001
                pass
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=2.0)
        for r in ranks:
            try:
                ray.kill(r.actor, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        for pg in pgs:
            try:
                remove_pg(pg)
            except Exception:  # noqa: BLE001
                pass
