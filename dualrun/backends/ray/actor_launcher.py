"""Ray backend: one placement group per unit, one actor per rank, the user's program in a fresh interpreter.

Why this shape: each actor holds exactly its bundle (one GPU, so LOCAL_RANK=0 and CUDA_VISIBLE_DEVICES is the
GPU Ray gave it) and runs `python -m dualrun.rank.bootstrap` as a subprocess in the launching directory with an env
built here on the driver from the driver's allow-listed env, so a script sees the same variable names as under
torchrun. Rank 0's actor picks MASTER_ADDR (its node) and a free port before any program starts (two-phase start).
The driver waits on Ray refs (no sleep polling), prints every line with a `[train rank N]` prefix, and on any
failure or signal stops all ranks and removes actors and placement groups.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterator, Mapping

from dualrun.contract import protocol
from dualrun.env.worker import forwarded_env
from dualrun.contract.redact import redact, redact_argv
from dualrun.contract.errors import LaunchError
from dualrun.light.interfaces import ifname_set, interfaces
from dualrun.launchers.loopback import refuse_loopback
from dualrun.light.interpreter import PYTHON
from dualrun.launchers.launcher import (JobResult, Launcher, Outcome, Prepared, bootstrap_cmd, join_cmd,
                                    server_preview_line, stopped_by)
from dualrun.backends.ray.rank_results import first_line
from dualrun.backends.ray.bundles import bundle_of, check_fits
from dualrun.backends.ray.rank_watch import SHUTDOWN_S, Rank, RankWatch
from dualrun.launchers.rendezvous_port import RANK0_STORE, refuse_taken, store_host, taken_error
from dualrun.plan.processes import AUTO, Cluster, Plan, Process
from dualrun.contract.protocol import ActorPlace, group_port_env
from dualrun.servers.planned import server_previews, started_when
from dualrun.servers.serverset import ServerDeath, ServerSet
from dualrun.weightsync.sync_group import group_host_env, node_host_env

_STOP_GRACE_S = 3.0     # SIGTERM -> SIGKILL for a worker's process group


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class RayLauncher(Launcher):
    name = "ray"

    def __init__(self, *args: Any, embedded_cpus: "Callable[[], int] | None" = None, **kwargs: Any) -> None:
        """`embedded_cpus`: the logical CPUs an embedded cluster declares (the backend works it out from the
        config: every actor of the plan at once), asked only when one is started."""
        super().__init__(*args, **kwargs)
        self._embedded_cpus = embedded_cpus or (lambda: 1)
        self._conn = None
        self._signal: int | None = None
        self._stop_time: float | None = None   # when this attempt's ranks were told to stop

    # -- cluster -------------------------------------------------------------------------------------------------
    def cluster(self) -> Cluster | None:
        """Connect (or start the embedded cluster) and return its live nodes for the plan."""
        from dualrun.backends.ray import cluster as raycluster

        if self._conn is None:
            self._conn = raycluster.connect(self.rdzv.options, self.rdzv.source, num_cpus=self._embedded_cpus())
        return raycluster.cluster_of(raycluster.alive_nodes())

    def close(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            conn.close()

    # -- env -----------------------------------------------------------------------------------------------------
    def bundle(self, p: Process) -> dict[str, float]:
        return bundle_of(self.rdzv.options, p)

    def rank_env(self, plan: Plan, p: Process, base: Mapping[str, str]) -> dict[str, str]:
        """One rank's env as prepared: `<auto>` where only the launch knows the value (`_placed_env` fills it); a
        `main_process_port` is the port rank 0's actor takes as it is (RankActor.info), so it is shown."""
        port = AUTO if self.rdzv.master_port is None else str(self.rdzv.master_port)
        env = self.worker_env(p.env, base=base, MASTER_ADDR=AUTO, MASTER_PORT=port)
        env["MASTER_ADDR"], env["MASTER_PORT"] = AUTO, port
        env["TORCHELASTIC_RUN_ID"] = self.run_id
        env["CUDA_VISIBLE_DEVICES"] = AUTO if p.devices else ""
        env["TORCHELASTIC_USE_AGENT_STORE"] = "False"   # rank 0 hosts the TCPStore itself
        env.pop(protocol.LOG_DIR, None)   # the rank's actor writes log_dir/<role>_<rank>.log
        env["TORCHELASTIC_ERROR_FILE"] = AUTO
        env["TORCHELASTIC_RESTART_COUNT"] = "0"
        omp = self.omp_threads(len(plan.workers) // max(1, self.rdzv.num_machines))
        if omp is None:
            env.pop("OMP_NUM_THREADS", None)
        else:
            env["OMP_NUM_THREADS"] = omp
        return env

    @staticmethod
    def _placed_env(prepared: Mapping[str, str], *, master: ActorPlace, gpus: str, node_rank: int, num_nodes: int,
                    error_file: str, restart: int) -> dict[str, str]:
        """A prepared rank env with what the placement decided filled in."""
        env = dict(prepared)
        env["MASTER_ADDR"], env["MASTER_PORT"] = master.ip, str(master.port)
        env["CUDA_VISIBLE_DEVICES"] = gpus
        env["NODE_RANK"] = env["GROUP_RANK"] = str(node_rank)
        env["GROUP_WORLD_SIZE"] = str(num_nodes)
        env["TORCHELASTIC_ERROR_FILE"] = error_file
        env["TORCHELASTIC_RESTART_COUNT"] = str(restart)
        return env

    def prepare(self, plan: Plan | None) -> Prepared:
        """Every rank's command and env (redacted only when shown); connects to nothing. A plan made on the live
        cluster is refused here (exit 2) when the cluster cannot hold all its actors at once."""
        assert plan is not None
        if plan.cluster.live:
            check_fits(plan)
            self._check_port_here(plan)
        base = forwarded_env()
        envs = {p.label: self.rank_env(plan, p, base) for p in plan.workers}
        if plan.cluster.addresses() > 1:   # nodes of their own addresses: loopback reaches none of the others
            refuse_loopback([*envs.values(), *({**base, **p.env} for p in plan.servers)],
                            f"{plan.cluster.addresses()} Ray nodes of their own addresses", interfaces())
        first = next(iter(envs.values()), {})
        shared = {k: v for k, v in first.items() if all(e.get(k) == v for e in envs.values())}
        servers = server_previews(plan, AUTO, devices=AUTO)   # Ray picks node and GPUs
        return Prepared(plan, tuple(bootstrap_cmd(self.program, PYTHON)), shared, os.getcwd(), rank_envs=envs,
                        servers=servers)

    def _check_port_here(self, plan: Plan) -> None:
        """Every node is this machine: rank 0 binds main_process_port here, so a taken one is refused before
        anything starts (elsewhere rank 0's actor checks it on its node: `start_ranks`)."""
        from dualrun.backends.ray.actor_servers import on_this_host

        if self.rdzv.master_port is not None and on_this_host(plan):
            refuse_taken(self.rdzv, self.rdzv.master_port, self._store_host(plan), RANK0_STORE)

    @staticmethod
    def _store_host(plan: Plan | None) -> str:
        """Where rank 0's store binds: loopback alone on a one-node cluster (`start_ranks`), else every address."""
        return store_host(bool(plan) and len(plan.cluster.nodes) == 1)

    def describe(self, prepared: Prepared) -> str:
        plan = prepared.plan
        assert plan is not None
        addr = self.rdzv.options.address or "a running cluster if reachable, else an embedded local one"
        lines = [f"# dualrun dry run: backend=ray, cluster {addr}; nothing was started",
                 f"# placement: one placement group per unit, strategy {self.rdzv.options.placement_strategy}, "
                 f"timeout {self.rdzv.options.placement_timeout_s:g} s; one actor per rank"
                 + ("" if ifname_set(prepared.env) else f"; on nodes of several addresses GLOO_SOCKET_IFNAME={AUTO} "
                    "for each rank and server whose env names no interface: its node's interface holding the node's "
                    "Ray address")
                 + ("" if prepared.env.get("VLLM_HOST_IP") else f"; on nodes of several addresses VLLM_HOST_IP={AUTO} "
                    "for each rank whose env sets none: its node's Ray address (the address trainer rank 0 gives the "
                    "rollout engines for the weight sync)"),
                 f"# every worker runs, in {prepared.cwd}:",
                 "#   " + join_cmd(redact_argv(prepared.argv)),
                 "# env shared by every worker:"]
        lines += [f"  {k}={join_cmd([v])}" for k, v in sorted(redact(prepared.env).items())]
        for p in plan.workers:
            own = {k: v for k, v in prepared.rank_envs[p.label].items() if k not in prepared.env}
            lines.append(f"# {p.label}: bundle {self.bundle(p)}, planned node {p.node}")
            lines += [f"  {k}={join_cmd([v])}" for k, v in sorted(redact(own).items())]
        for p, (label, argv, shown) in zip(plan.servers, prepared.servers):
            lines.append(f"# {label}: bundle {self.bundle(p)}, {started_when(plan, label)}, in "
                         f"{prepared.cwd}: " + server_preview_line(shown, argv))
        return "\n".join(lines)

    # -- launch: on failure the whole job restarts up to max_failures times (torchrun's semantics). Servers stay up
    # across restarts of the trainers; a server that died is replaced by a fresh one on a fresh port (the policy:
    # Launcher.launch) ----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        if self._conn is None:
            self.cluster()
        restore = self._trap_signals()
        try:
            yield
        finally:
            restore()

    def server_set(self, plan: Plan | None, attempt: int, avoid: frozenset[str]) -> ServerSet:
        """Separate roles: each server in its own placement group and actor (actor_servers.py)."""
        from dualrun.backends.ray.cluster import Gang
        from dualrun.backends.ray.actor_servers import RayServers

        servers = RayServers(plan, self.run_id, env_for=lambda p: self.worker_env(p.env, base=forwarded_env()),
                             wiring=plan.wiring_env, bundle=self.bundle,
                             gang=lambda check: Gang(self.rdzv.options, self.rdzv.source, check),
                             wait_s=max(60.0, self.rdzv.options.placement_timeout_s), check=self._check_signal,
                             attempt=attempt, avoid=avoid)
        servers.follower.hold(True)   # no room asked for a spare before the ranks have theirs (`_attempt`)
        return servers

    def start_servers(self, servers: ServerSet | None, plan: Plan | None) -> JobResult | None:
        """Placed before any trainer starts and started beside them; the trainers get the plugin's wiring of their
        addresses (also for user-run servers, `address:`). Signals are seen while Ray places and starts them."""
        try:
            failed = super().start_servers(servers, plan)
        except _Interrupted as e:
            return stopped_by(e.signum, "every server was stopped")
        if failed is None and servers is not None:
            servers.watch()   # for the whole job: each attempt's supervision takes the death events
        return failed

    def signalled(self) -> bool:
        return self._signal is not None

    def server_grace_s(self, restarting: bool) -> float:
        return _STOP_GRACE_S if restarting or self._signal is not None else 10.0

    def run_attempt(self, prepared: Prepared, attempt: int, servers: ServerSet | None) -> Outcome:
        result, dead = self._attempt(prepared, attempt, servers)
        if result.ok or result.exit_code in (130, 143):
            return Outcome(result, None, dead)
        return Outcome(result, f"{(result.message or 'the job failed').splitlines()[0]}; restarting the job", dead)

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

    def _attempt(self, prepared: Prepared, attempt: int,
                 servers: ServerSet | None) -> tuple[JobResult, tuple[ServerDeath, ...]]:
        """Place and start every rank, supervise them to their end; the result and the server whose death ended
        it (if one did)."""
        from ray.exceptions import RayError

        from dualrun.backends.ray.cluster import Gang

        self._stop_time = None
        gang = Gang(self.rdzv.options, self.rdzv.source, self._check_signal)
        ranks: list[Rank] = []
        began = 0.0   # when the ranks' stop began (`stopping`)
        follower = getattr(servers, "follower", None)   # a fleet's room is asked for once the ranks have theirs
        try:
            try:
                ranks = self.place_ranks(prepared.plan, attempt, gang)
                if follower is not None:
                    follower.hold(False)
                self.start_ranks(prepared, ranks, attempt, servers.wiring_env() if servers is not None else {})
                watch = RankWatch(ranks, servers, lambda: self._stop_all(ranks, wait=False),
                                    self._check_signal).run()
                dead = (watch.server_failure,) if watch.server_failure is not None else ()
                return watch.result(self._stop_time), dead
            except RayError as e:
                raise LaunchError(f"the Ray workers could not start: {first_line(e)}", 1) from None
            except _Interrupted as e:
                began = time.monotonic()
                self._stop_all(ranks)
                return stopped_by(e.signum), ()
        finally:   # every program stopped, every actor killed, every placement group removed
            began = began or time.monotonic()
            if follower is not None:   # held before the ranks' room is given back: a restart's ranks get it again
                follower.hold(True)
            self._stop_all(ranks)
            gang.call_all("cleanup", timeout=2.0)
            gang.stop()
            self.stopping["the ranks"] = time.monotonic() - began

    def place_ranks(self, plan: Plan, attempt: int, gang: Any) -> list[Rank]:
        """One placement group per unit, one actor per rank in it (rank order: rank 0's actor first)."""
        from dualrun.backends.ray.actors.rank_actor import RankWorker

        ranks: list[Rank] = []
        by_unit: dict[str, list[Process]] = {}
        for p in plan.workers:
            by_unit.setdefault(p.unit, []).append(p)
        for unit, procs in by_unit.items():
            pg = gang.place(f"{self.run_id}-{unit}-{attempt}", procs[0].roles[0], [self.bundle(p) for p in procs])
            for i, p in enumerate(procs):
                b = self.bundle(p)
                ranks.append(Rank(p, gang.spawn(
                    RankWorker, pg, i, self.run_id, p.label, num_cpus=b.get("CPU", 0), num_gpus=b.get("GPU", 0),
                    max_concurrency=4, max_restarts=0, name=f"{self.run_id}-{p.unit}-{p.rank}-{attempt}")))
        return ranks

    def start_ranks(self, prepared: Prepared, ranks: list[Rank], attempt: int, wiring: Mapping[str, str]) -> None:
        """Phase 1: where did each actor land (rank 0 picks the port); phase 2: start every program."""
        host = self._store_host(prepared.plan)
        infos = self._get([r.actor.info.remote(r.proc.rank == 0, self.rdzv.master_port, host) for r in ranks],
                          "start their actors")
        for r, info in zip(ranks, infos):
            r.info = info
        master = next(r.info for r in ranks if r.proc.rank == 0)
        if master.taken is not None:   # nothing started yet: the actors go, the job ends with the one line
            raise taken_error(self.rdzv, int(master.port or 0), master.taken, f"rank 0's node {master.ip}",
                              RANK0_STORE)
        order: list[str] = []   # node ids in rank order: the node ranks
        for info in infos:
            if info.node_id not in order:
                order.append(info.node_id)
        argv = list(prepared.argv)
        call = None
        if self.program.call_file:   # Python API: the pickled call travels to each node through its actor
            from dualrun.backends.ray.actors.rank_actor import CALL

            with open(self.program.call_file, "rb") as f:
                call = f.read()
            argv = [CALL if a == self.program.call_file else a for a in argv]
        log_dir = self.rdzv.log_dir
        from dualrun.backends.ray.actor_servers import grows_elsewhere, on_this_host

        # nodes of several addresses, now or once a fleet grows onto a node that joins
        several = bool(prepared.plan and (prepared.plan.cluster.addresses() > 1 or grows_elsewhere(prepared.plan)))

        one_host = bool(prepared.plan and on_this_host(prepared.plan))   # every node is this machine
        weight_sync = bool(prepared.plan and prepared.plan.weight_sync)
        given: set[str] = set()   # the interfaces dualrun gave gloo
        refs = []
        for r in ranks:
            err = os.path.join(r.info.tmp or "", f"attempt_{attempt}", str(r.proc.rank), "error.json")
            r.env = self._placed_env(prepared.rank_envs[r.proc.label], master=master, gpus=",".join(r.info.gpus),
                                     node_rank=order.index(r.info.node_id), num_nodes=len(order), error_file=err,
                                     restart=attempt)
            if len(order) == 1:   # one node: rank 0's store listens on loopback alone (light/loopback_store.py)
                r.env["MASTER_ADDR"] = "127.0.0.1"
            r.env.update(wiring)
            r.env.update(group_port_env(weight_sync, master.group_port))
            r.env.update(group_host_env(weight_sync, r.env, one_host))
            r.env.update(node_host_env(r.env, r.info.ip if several else None))   # the weight-sync master's address
            if several and r.info.interface and not ifname_set(r.env):
                r.env["GLOO_SOCKET_IFNAME"] = r.info.interface
                given.add(r.info.interface)
        gloo = (f", GLOO_SOCKET_IFNAME={'/'.join(sorted(given))} (each node's interface holding its Ray address)"
                if given else "")
        print(f"dualrun: {', '.join(sorted({r.proc.unit for r in ranks}))}: {len(ranks)} worker(s) placed on "
              f"{len(order)} node(s), master {master.address}{gloo}; starting the program", file=sys.stderr,
              flush=True)
        for r in ranks:
            log = os.path.abspath(os.path.join(log_dir, f"{r.proc.unit}_{r.proc.rank}.log")) if log_dir else None
            refs.append(r.actor.start.remote(argv, r.env, prepared.cwd, log, call))
        self._get(refs, "start the program")

    def _get(self, refs: list[Any], what: str) -> list[Any]:
        from dualrun.backends.ray.cluster import wait_refs

        return wait_refs(refs, what, max(60.0, self.rdzv.options.placement_timeout_s), self._check_signal)

    def _stop_all(self, ranks: list[Rank], wait: bool = True) -> None:
        """SIGTERM (SIGKILL after a grace) every rank's program; `wait` for them at most SHUTDOWN_S."""
        from dualrun.backends.ray.cluster import call_each

        if self._stop_time is None:
            self._stop_time = time.time()
        call_each([r.actor for r in ranks], "stop", _STOP_GRACE_S, timeout=SHUTDOWN_S if wait else None)

