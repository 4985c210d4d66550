"""torchrun backend: runs torch.distributed.run for this node, in this process, like `accelerate launch`.

Multi-node is by hand, as with accelerate: the same command on every node with `--machine_rank` and
`--main_process_ip`. Workers get the allow-listed launching env, accelerate's env for the config and the plan's
env; torchrun adds the rank variables itself.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from typing import Any, Iterator, Mapping

from dualrun.contract import protocol
from dualrun.env.worker import TORCHRUN_NAMES
from dualrun.contract.redact import redact, redact_argv
from dualrun.contract.errors import LaunchError
from dualrun.launchers.launcher import (JobResult, Launcher, Outcome, Prepared, RankResult, bootstrap_module_argv,
                                    join_cmd, server_preview_line, stopped_by)
from dualrun.backends.torchrun.agent_results import first_failure, not_met, server_died
from dualrun.backends.torchrun.machine_watch import MachineWatch
from dualrun.backends.torchrun.serve_only import announce, machines_with_ranks, serve, serving_machines
from dualrun.light.held_stores import held_stores
from dualrun.plan.optional import optional_machines
from dualrun.plan.processes import AUTO, Plan
from dualrun.light.interfaces import Interface, gloo_ifname
from dualrun.launchers.loopback import refuse_loopback
from dualrun.light.ports import free_port
from dualrun.light.loopback_store import loopback_stores
from dualrun.launchers.rendezvous_port import DEFAULT_PORT, on_loopback
from dualrun.servers.local import LOOPBACK, LocalServers
from dualrun.backends.torchrun.machine_servers import BIND, Machines
from dualrun.backends.torchrun.machine_store import await_attempt, take_token
from dualrun.servers.planned import server_previews, started_when
from dualrun.servers.serverset import ServerDeath, ServerSet
from dualrun.weightsync.sync_group import group_host_env, node_host_env


class TorchrunLauncher(Launcher):
    name = "torchrun"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rdzv_port: int | None = None   # picked at first use; a single machine's restart picks a fresh one
        self._route: tuple[str | None, dict] | None = None   # several machines: this machine's address to machine 0
        self._gloo_note: str | None = None

    def _port(self) -> int:
        if self._rdzv_port is None:
            port = self.rdzv.master_port
            if port is None:
                port = free_port() if self.rdzv.num_machines == 1 else DEFAULT_PORT
            self._rdzv_port = port
        return self._rdzv_port

    def _addr(self) -> str:
        return self.rdzv.master_addr or "127.0.0.1"

    def with_gloo(self, env: dict[str, str]) -> dict[str, str]:
        """Several machines: `env` with GLOO_SOCKET_IFNAME set to the interface holding the address the other
        machines reach this one at (light/interfaces.py: `reached_at`, `gloo_ifname`), where it names no interface
        itself."""
        found = self._gloo_interface(env)
        return {**env, "GLOO_SOCKET_IFNAME": found.name} if found is not None else env

    def _machine_route(self) -> tuple[str | None, dict] | None:
        """Several machines: the address the other machines reach this one at (its route to machine 0) and this
        machine's interfaces, looked up once (every process of this machine shares them); None on one machine."""
        from dualrun.light.interfaces import interfaces, reached_at

        if self.rdzv.num_machines < 2:
            return None
        if self._route is None:
            self._route = (reached_at(self._addr()), interfaces())
        return self._route

    def _gloo_interface(self, env: dict[str, str]) -> "Interface | None":
        route = self._machine_route()
        return None if route is None else gloo_ifname(env, *route)

    def _reached_at(self) -> str | None:
        """Several machines: the address the other machines reach this one at."""
        route = self._machine_route()
        return None if route is None else route[0]

    def gloo_note(self, env: dict[str, str]) -> str | None:
        """The start-up line (and dry-run comment) saying what dualrun gave gloo on this machine, if anything."""
        found = self._gloo_interface(env)
        if found is None:
            return None
        return (f"GLOO_SOCKET_IFNAME={found.name} for this machine's processes: {found.name} holds {found.address}, the "
                f"address the other machines reach it at (its route to main_process_ip {self._addr()}; unset, gloo "
                "takes what the host name resolves to); set GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME to choose yourself")

    def refuse_loopback(self, plan: Plan) -> None:
        """Several machines: exit 2 where a process of this machine would get an interface variable naming loopback
        (launchers/loopback.py), before anything starts; each machine refuses on its own."""
        route = self._machine_route()
        if route is None or (route[0] or "127.").startswith("127."):   # machine 0 on this host's loopback: lo works
            return
        mine = [p for p in plan.processes if p.node == self.rdzv.machine_rank]
        found = gloo_ifname({}, *route)
        refuse_loopback((self.worker_env(p.env) for p in mine), f"num_machines {self.rdzv.num_machines}", route[1],
                        found.name if found is not None else None)

    def serves_only(self, plan: Plan) -> bool:
        """This machine runs no trainer rank (the trainers' `machines` leaves it out): it only serves."""
        return self.rdzv.num_machines > 1 and self.rdzv.machine_rank not in machines_with_ranks(plan)

    def node_workers(self, plan: Plan):
        mine = [p for p in plan.workers if p.node == self.rdzv.machine_rank]
        if not mine:
            raise LaunchError(f"the plan has no worker on machine_rank {self.rdzv.machine_rank}", 2)
        return mine

    def torchrun_argv(self, plan: Plan) -> list[str]:
        job = self.rdzv
        nproc = len(self.node_workers(plan))
        with_ranks = machines_with_ranks(plan)   # torchrun's nodes
        argv = ["--nnodes", str(len(with_ranks)), "--nproc-per-node", str(nproc),
                "--node-rank", str(with_ranks.index(job.machine_rank)), "--master-addr", self._addr(),
                "--master-port", str(self._port()), "--rdzv-backend", job.options.rdzv_backend,
                "--max-restarts", str(job.max_failures), "--monitor-interval", str(job.options.monitor_interval)]
        argv += ["--rdzv-id", self.rdzv_id()]
        if job.options.rdzv_backend != "static":
            argv += ["--rdzv-endpoint", f"{self._addr()}:{self._port()}"]
        if job.num_machines > 1:   # how long this machine waits for the others (static: its store's timeout)
            wait = "timeout" if job.options.rdzv_backend == "static" else "join_timeout"
            argv += ["--rdzv-conf", f"{wait}={job.options.rendezvous_timeout_s}"]
        log_dir = job.options.log_dir or job.log_dir
        if log_dir:
            argv += ["--log-dir", log_dir, "--tee", "3"]
        return argv + bootstrap_module_argv(self.program)

    def rdzv_id(self) -> str:
        # every node of a multi-node job must agree on it without talking: derive it from the job's address.
        if self.rdzv.num_machines > 1:
            return f"dualrun-{self._addr()}-{self._port()}"
        return self.run_id

    def agent_env(self, plan: Plan) -> dict[str, str]:
        """The env torchrun (and so every worker) starts with; torchrun adds the rank variables."""
        first = self.node_workers(plan)[0]
        env = self.worker_env(first.env, MASTER_ADDR=self._addr(), MASTER_PORT=str(self._port()))
        env = self.with_gloo(env)
        env.update(node_host_env(env, self._reached_at()))   # several machines: the weight-sync master's address
        for name in TORCHRUN_NAMES:
            if name in first.env:
                env.pop(name, None)
        omp = self.omp_threads(len(self.node_workers(plan)))
        if omp is not None:
            env["OMP_NUM_THREADS"] = omp
        env.pop(protocol.LOG_DIR, None)
        if self.rdzv.log_dir:   # each rank also appends its output to log_dir/<role>_<rank>.log (rank/log_tee.py)
            env[protocol.LOG_DIR] = os.path.abspath(os.path.expanduser(self.rdzv.log_dir))
        return {k: v for k, v in env.items() if v != AUTO}

    def prepare(self, plan: Plan | None) -> Prepared:
        """This node's torchrun command and env, and the servers it starts (their port is picked free at
        launch)."""
        assert plan is not None
        bind = LOOPBACK.bind if self.rdzv.num_machines == 1 else BIND   # as the launch binds them
        servers = server_previews(plan, bind, node=self.rdzv.machine_rank)
        self.refuse_loopback(plan)
        if self.serves_only(plan):   # no torchrun agent here: its servers, the store's exchange, the watch
            mine = [p for p in plan.servers if p.node == self.rdzv.machine_rank]
            self._gloo_note = self.gloo_note(self.worker_env(mine[0].env))
            return Prepared(plan, (), {}, os.getcwd(), servers=servers)
        argv = [sys.executable, "-m", "torch.distributed.run"] + self.torchrun_argv(plan)
        env = self.agent_env(plan)
        self._gloo_note = self.gloo_note(self.worker_env(self.node_workers(plan)[0].env))
        return Prepared(plan, tuple(argv), env, os.getcwd(), servers=servers)

    def launch(self, prepared: Prepared) -> JobResult:
        if self._gloo_note:
            print(f"dualrun: {self._gloo_note}", file=sys.stderr, flush=True)
        if not self.job_token and self._machines(prepared.plan):   # machine K >= 1: machine 0's, before any server
            try:
                self.job_token = take_token(self._addr(), self._port(), self.rdzv.machine_rank,
                                            self.rdzv.options.rendezvous_timeout_s)
            except LaunchError as e:
                return JobResult(e.exit_code, message=str(e))
        return super().launch(prepared)

    def _machines(self, plan: Plan | None) -> bool:
        """Several machines whose servers meet in torchrun's store (machine_servers.py), the job's secret with them."""
        return self.rdzv.num_machines > 1 and plan is not None and bool(plan.servers)

    def describe(self, prepared: Prepared) -> str:
        lines = [f"# dualrun dry run: backend=torchrun, machine_rank {self.rdzv.machine_rank} of "
                 f"{self.rdzv.num_machines}; nothing was started", f"cd {join_cmd([prepared.cwd])}"]
        note = self._gloo_note
        if note:
            lines.insert(1, f"# {note}")
        for label, argv, shown in prepared.servers:
            lines.append(f"# {label}, {started_when(prepared.plan, label)}: " + server_preview_line(shown, argv))
        if not prepared.argv:
            lines.append(f"# machine {self.rdzv.machine_rank} runs no ranks and no torchrun agent: it serves, hands its "
                         f"servers' addresses to machine 0's store at {self._addr()}:{self._port()} and ends when "
                         "machine 0's ranks end"
                         + ("; it is optional: launched while the job runs it joins, and SIGTERM drains its replicas "
                            "and ends it with exit 0" if self.rdzv.machine_rank in optional_machines(prepared.plan)
                            else ""))
            return "\n".join(lines)
        lines.append("env -i \\")
        lines += [f"  {k}={join_cmd([v])} \\" for k, v in sorted(redact(prepared.env).items())]
        lines.append("  " + join_cmd(redact_argv(prepared.argv)))
        return "\n".join(lines)

    # -- launch: a server that dies ends the job (or, with max_failures, restarts it with fresh servers on fresh
    # ports: Launcher.launch); torchrun restarts the workers itself ----------------------------------------------
    def server_set(self, plan: Plan | None, attempt: int, avoid: frozenset[str]) -> "LocalServers | Machines":
        """Separate roles: their servers start beside the trainers (on their own devices), the trainers get their
        addresses; on several machines those meet in torchrun's store (machine_servers.py)."""
        assert plan is not None
        local = LocalServers(plan, lambda p: self.with_gloo(self.worker_env(p.env)), lambda addresses: self._wiring(plan, addresses),
                             avoid=avoid)
        if self._machines(plan):   # machine 0 hands out the secret it made, not one the user gave it
            return Machines(local, self._addr(), self._port(), attempt, "" if self.token_given else self.job_token)
        return local

    def _wiring(self, plan: Plan, addresses: Mapping[str, str]) -> dict[str, str]:
        """The trainers' env (the same on every machine): the method's wiring of the servers' addresses and a free
        weight-sync port on this machine (machine 0 holds trainer rank 0, the weight-sync master; only rank 0's
        value is used)."""
        from dualrun.weightsync.sync_group import port_host

        env = plan.wiring_env(addresses)
        env.update(protocol.group_port_env(plan.weight_sync, free_port(port_host(self.rdzv))))
        return env

    def servers_not_started(self, servers: Any, error: LaunchError) -> None:
        if isinstance(servers, Machines):
            servers.not_started(str(error))   # machine K >= 1: machine 0 ends too

    def run_attempt(self, prepared: Prepared, attempt: int, servers: Any) -> Outcome:
        job = self.rdzv
        if self.serves_only(prepared.plan):
            return serve(servers, self._addr(), self._port(), job.machine_rank, job.num_machines,
                         job.options.machine_timeout_s, attempt < job.max_failures)
        serving = serving_machines(prepared.plan, job.num_machines) if job.machine_rank == 0 else []
        fleet = getattr(servers, "fleet", None)   # optional machines: only those present wait for the result
        now = lambda: [k for k in serving if k not in optional_machines(prepared.plan)] + (  # noqa: E731
            fleet.present() if fleet is not None else [])
        with held_stores() if serving else contextlib.nullcontext([]) as held:   # the store outlives the agent
            try:
                result = self._run_agent(prepared, attempt, servers)
            except BaseException:
                announce(held, Outcome(JobResult(1, message="machine 0's launcher was stopped")), False, now())
                raise
            # several machines: a dead server ends the attempt on every machine (each watches the others' servers
            # it depends on), and each restarts; machine K waits for machine 0's new store (`before_restart`)
            outcome = Outcome(result) if servers.failure is None else Outcome(
                result, f"{servers.failure.one_line()}; restarting the job with fresh servers", (servers.failure,))
            announce(held, outcome, attempt < job.max_failures, now())   # the machines that only serve
        return outcome

    def before_restart(self, prepared: Prepared, attempt: int) -> Prepared:
        if self.rdzv.num_machines > 1 and self.rdzv.machine_rank != 0 and prepared.plan and prepared.plan.servers:
            await_attempt(self._addr(), self._port(), attempt)
        if self.rdzv.master_port is None and self.rdzv.num_machines == 1:
            self._rdzv_port = None   # a fresh rendezvous port too
            return self.prepare(prepared.plan)
        return prepared

    def _agent_args(self, prepared: Prepared, attempt: int) -> Any:
        """torchrun's parsed arguments; the script's own arguments bypass torchrun's parser (`--n` must not match
        torchrun's `--nnodes`)."""
        from torch.distributed.run import parse_args

        argv = list(prepared.argv[3:])   # after `python -m torch.distributed.run`
        script_args = self.program.bootstrap_argv()
        args = parse_args(argv[: len(argv) - len(script_args)])
        args.training_script_args = script_args
        args.max_restarts = max(0, self.rdzv.max_failures - attempt)   # one budget for worker and server failures
        return args

    def _job_env(self, prepared: Prepared, attempt: int, servers: ServerSet) -> dict[str, str]:
        extra = {protocol.JOB_TOKEN: self.job_token, **servers.wiring_env()}   # machine K: read at launch
        weight_sync = bool(prepared.plan is not None and prepared.plan.weight_sync)
        extra.update(group_host_env(weight_sync, prepared.env, self.rdzv.num_machines == 1))
        if attempt:   # restarted by dualrun (a server died): torchrun's own count starts again at 0
            extra[protocol.JOB_RESTARTS] = str(attempt)
        return {**prepared.env, **extra}

    def _run_agent(self, prepared: Prepared, attempt: int, servers: "LocalServers | Machines") -> JobResult:
        """torchrun's agent for this machine, beside the running servers, to its end."""
        from torch.distributed.elastic.multiprocessing.api import SignalException, _terminate_process_handler
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import run

        start = time.monotonic()
        args = self._agent_args(prepared, attempt)
        env = self._job_env(prepared, attempt, servers)
        machines = servers if isinstance(servers, Machines) else None
        if machines is not None:
            machines.attempt = attempt
        watch = None
        with _only_env(env):   # the agent and its workers see exactly the job's env; ours comes back after
            if threading.current_thread() is threading.main_thread():
                # torchrun's agent turns SIGTERM into SignalException and stops every worker: a dead server does that
                servers.watch()
                _end_job_on_death(servers, _terminate_process_handler)
                if self.rdzv.num_machines > 1:   # a machine that goes silent ends the job the same way
                    watch = MachineWatch(self._addr(), self._port(), self.rdzv.machine_rank, self.rdzv.num_machines,
                                         self.rdzv.options.machine_timeout_s,
                                         lambda line: _end_job(servers, line, _terminate_process_handler),
                                         join_timeout_s=self.rdzv.options.rendezvous_timeout_s,
                                         workers_started=lambda: signal.getsignal(signal.SIGTERM)
                                         is _terminate_process_handler, optional=optional_machines(prepared.plan))
                    watch.start()
            if machines is not None:   # the machines' servers meet in torchrun's store
                machines.share()
            try:
                with self._rendezvous_binding():
                    run(args)
            except (ChildFailedError, SignalException, json.JSONDecodeError) as e:
                servers.unwatch()
                if watch is not None and self.rdzv.machine_rank != 0:
                    watch.leave()   # before machine 0 settles
                try:
                    return self._ended(e, servers, machines, prepared.plan, start, watch)
                finally:
                    if watch is not None:
                        watch.leave()
            except BaseException as e:
                if watch is not None:
                    watch.stop()
                    missed = not_met(e, watch, self.rdzv.options.rendezvous_timeout_s)
                    if missed is not None:   # torchrun's rendezvous gave up before the watch did
                        servers.unwatch()
                        return JobResult(1, wall_time_s=time.monotonic() - start, message=missed)
                raise
            servers.unwatch()   # every machine's ranks passed torchrun's exit barrier: servers may end now
            if watch is not None:
                watch.leave()
            if machines is not None:
                machines.finish()   # several machines: before this one's servers stop
        ranks = [RankResult(p.label, p.rank, 0) for p in self.node_workers(prepared.plan)]
        return JobResult(0, ranks, time.monotonic() - start)

    def _rendezvous_binding(self) -> "contextlib.AbstractContextManager[None]":
        """One machine: the agent's store listens on loopback alone (torch's would listen on every interface)."""
        if on_loopback(self.rdzv.num_machines == 1, self._addr()):
            return loopback_stores()
        return contextlib.nullcontext()

    def _ended(self, e: Exception, servers: "LocalServers | Machines", machines: Machines | None, plan: Plan,
               start: float, watch: MachineWatch | None = None) -> JobResult:
        """The result of an agent that raised `e`: the server whose death it was, else a machine gone silent
        (several machines), else the ranks' failure."""
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        unit = self.node_workers(plan)[0].unit
        if watch is not None and watch.failure is not None:
            return JobResult(1, wall_time_s=time.monotonic() - start, message=watch.failure)
        if isinstance(e, ChildFailedError):
            # a server died first and the workers failed for it: the cause
            if (machines.settle() if machines is not None else servers.check()) is not None:
                return server_died(servers, start)
            failed = first_failure(e, time.monotonic() - start, unit)
            lost = watch.settle() if watch is not None else None   # another machine gone: the likely cause
            if lost is not None:
                return JobResult(failed.exit_code, failed.ranks, time.monotonic() - start,
                                 message=f"{lost} ({failed.message})")
            return failed
        if isinstance(e, SignalException):
            if servers.failure is not None:
                return server_died(servers, start)
            return stopped_by(int(e.sigval), wall_time_s=time.monotonic() - start)
        # torchrun's agent reads a failed rank's error file and gives up on one cut off mid-write (torch's own
        # `@record` writes it in place, and the rank may be stopped meanwhile); its workers are stopped
        return JobResult(1, wall_time_s=time.monotonic() - start, message=(
            f"a {unit} rank failed and torchrun could not read the error file it left ({e}); its output above says "
            "why"))


@contextlib.contextmanager
def _only_env(env: dict[str, str]) -> Iterator[None]:
    """os.environ is exactly `env` inside, the launcher's own again after. What accelerate's `clear_environment`
    does, without importing accelerate (0.3-0.5 s on 2 cores, before torchrun's agent could start)."""
    saved = os.environ.copy()
    os.environ.clear()
    try:
        os.environ.update(env)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _end_job_on_death(servers: ServerSet, agent_handler: Any) -> threading.Thread:
    """A thread that ends this attempt at the first server death reported while the servers are watched."""

    def run() -> None:
        while not servers.stopping:
            death = servers.next_death(timeout=0.25)
            if death is not None and servers.watching:
                _end_job(servers, death, agent_handler)
                return

    thread = threading.Thread(target=run, name="dualrun-server-deaths", daemon=True)
    thread.start()
    return thread


def _end_job(servers: ServerSet, failure: "ServerDeath | str", agent_handler: Any) -> None:
    """From a watcher thread (a dead server, or the machine watch: a machine gone silent): end this attempt because
    of `failure`. Once the workers run, torchrun's agent turns SIGTERM into SignalException and stops them (the
    launch then names the failure). Before, its rendezvous may wait in C++ for another machine (no Python signal
    handler runs there): the error is printed, the servers are stopped and the launcher exits with code 1."""
    if signal.getsignal(signal.SIGTERM) is agent_handler:
        os.kill(os.getpid(), signal.SIGTERM)
        return
    print(f"dualrun: error: {failure}", file=sys.stderr, flush=True)
    servers.stop()
    os._exit(1)
