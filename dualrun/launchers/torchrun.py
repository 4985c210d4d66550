"""torchrun backend: runs torch.distributed.run for this node, in this process, like `accelerate launch`.

Multi-node is by hand, as with accelerate: the same command on every node with `--machine_rank` and
`--main_process_ip`. Workers get the allow-listed launching env, accelerate's env for the config and the plan's
env; torchrun adds the rank variables itself.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Any

from dualrun import protocol
from dualrun.envspec import TORCHRUN_NAMES, redact
from dualrun.errors import LaunchError
from dualrun.launchers.base import (JobResult, Launcher, Prepared, RankResult, bootstrap_module_argv, join_cmd,
                                    failed_job, report_servers, server_preview_line, stopped_by)
from dualrun.plan import AUTO, Plan
from dualrun.ports import free_port
from dualrun.servers.local import LocalServers, server_previews
from dualrun.servers.machines import await_attempt, finish, not_started, share


class TorchrunLauncher(Launcher):
    name = "torchrun"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._used_ports: set[int] = set()   # every server port of this launch: a restart never reuses one
        self._server_failure: Any = None     # the server whose death ended the last attempt
        self._attempt_no = 0

    def _port(self) -> int:
        if not hasattr(self, "_chosen_port"):
            port = self.cfg.main_process_port
            if port is None:
                port = free_port() if self.cfg.num_machines == 1 else 29500
            self._chosen_port = port
        return self._chosen_port

    def _addr(self) -> str:
        return self.cfg.main_process_ip or "127.0.0.1"

    def node_workers(self, plan: Plan):
        mine = [p for p in plan.workers if p.node == self.cfg.machine_rank]
        if not mine:
            raise LaunchError(f"the plan has no worker on machine_rank {self.cfg.machine_rank}", 2)
        return mine

    def torchrun_argv(self, plan: Plan) -> list[str]:
        cfg = self.cfg
        nproc = len(self.node_workers(plan))
        argv = ["--nnodes", str(cfg.num_machines), "--nproc-per-node", str(nproc),
                "--node-rank", str(cfg.machine_rank), "--master-addr", self._addr(),
                "--master-port", str(self._port()), "--rdzv-backend", cfg.torchrun.rdzv_backend,
                "--max-restarts", str(cfg.max_failures), "--monitor-interval", str(cfg.torchrun.monitor_interval)]
        argv += ["--rdzv-id", self.rdzv_id()]
        if cfg.torchrun.rdzv_backend != "static":
            argv += ["--rdzv-endpoint", f"{self._addr()}:{self._port()}"]
        log_dir = cfg.torchrun.log_dir or cfg.log_dir
        if log_dir:
            argv += ["--log-dir", log_dir, "--tee", "3"]
        return argv + bootstrap_module_argv(self.program)

    def rdzv_id(self) -> str:
        # every node of a multi-node job must agree on it without talking: derive it from the job's address.
        if self.cfg.num_machines > 1:
            return f"dualrun-{self._addr()}-{self._port()}"
        return self.run_id

    def agent_env(self, plan: Plan) -> dict[str, str]:
        """The env torchrun (and so every worker) starts with; torchrun adds the rank variables."""
        first = self.node_workers(plan)[0]
        env = self.worker_env(first.env, MASTER_ADDR=self._addr(), MASTER_PORT=str(self._port()))
        for name in TORCHRUN_NAMES:
            if name in first.env:
                env.pop(name, None)
        omp = self.omp_threads(len(self.node_workers(plan)))
        if omp is not None:
            env["OMP_NUM_THREADS"] = omp
        return {k: v for k, v in env.items() if v != AUTO}

    def prepare(self, plan: Plan | None) -> Prepared:
        """This node's torchrun command and env, and the servers it starts first (their port is picked free at
        launch)."""
        assert plan is not None
        servers = server_previews(self.cfg, self.plugin, plan, "127.0.0.1", node=self.cfg.machine_rank)
        argv = [sys.executable, "-m", "torch.distributed.run"] + self.torchrun_argv(plan)
        return Prepared(plan, tuple(argv), self.agent_env(plan), os.getcwd(), servers=servers)

    def describe(self, prepared: Prepared) -> str:
        lines = [f"# dualrun dry run: backend=torchrun, machine_rank {self.cfg.machine_rank} of "
                 f"{self.cfg.num_machines}; nothing was started", f"cd {join_cmd([prepared.cwd])}"]
        for label, argv, shown in prepared.servers:
            lines.append(f"# {label}, started first: " + server_preview_line(shown, argv))
        lines.append("env -i \\")
        lines += [f"  {k}={join_cmd([v])} \\" for k, v in sorted(redact(prepared.env).items())]
        lines.append("  " + join_cmd(prepared.argv))
        return "\n".join(lines)

    # -- launch: a server that dies ends the job (or, with max_failures, restarts it with fresh servers on fresh
    # ports); torchrun restarts the workers itself ------------------------------------------------------------
    def run_attempt(self, prepared: Prepared, attempt: int) -> JobResult:
        self._attempt_no = attempt
        result, servers = self._attempt(prepared, attempt, self._used_ports)
        self._used_ports |= servers.ports_used
        self._server_failure = servers.failure
        return result

    def restart_cause(self, result: JobResult) -> str | None:
        # several machines: a dead server ends the attempt on every machine (each watches the others' servers it
        # depends on), and each restarts; machine K waits for machine 0's new store (`before_restart`)
        if self._server_failure is None:
            return None
        return f"{self._server_failure.one_line()}; restarting the job with fresh servers"

    def before_restart(self, prepared: Prepared) -> Prepared:
        if self.cfg.num_machines > 1 and self.cfg.machine_rank != 0 and prepared.plan and prepared.plan.servers:
            await_attempt(self._addr(), self._port(), self._attempt_no + 1)
        if self.cfg.main_process_port is None and self.cfg.num_machines == 1:
            self.__dict__.pop("_chosen_port", None)   # a fresh rendezvous port too
            return self.prepare(prepared.plan)
        return prepared

    def _attempt(self, prepared: Prepared, attempt: int, used_ports: set[int]) -> "tuple[JobResult, LocalServers]":
        from accelerate.utils import clear_environment
        from torch.distributed.elastic.multiprocessing.api import SignalException, _terminate_process_handler
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import parse_args, run

        start = time.monotonic()
        plan = prepared.plan
        assert plan is not None
        # separate roles: their servers start first (on their own devices), the trainers get their addresses
        servers = LocalServers(self.cfg, self.plugin, plan, lambda p: self.worker_env(p.env), avoid_ports=used_ports)
        try:
            servers.start()
            report_servers(servers.addresses, plan.external)
        except LaunchError as e:
            not_started(servers, self._addr(), self._port(), str(e))   # machine K >= 1: machine 0 ends too
            return JobResult(e.exit_code, wall_time_s=time.monotonic() - start, message=str(e)), servers
        # the script's own arguments bypass torchrun's parser: `--n` must not match torchrun's `--nnodes`
        argv = list(prepared.argv[3:])   # after `python -m torch.distributed.run`
        script_args = self.program.bootstrap_argv()
        args = parse_args(argv[: len(argv) - len(script_args)])
        args.training_script_args = script_args
        args.max_restarts = max(0, self.cfg.max_failures - attempt)   # one budget for worker and server failures
        extra = servers.wiring_env(f"{self._addr()}:{self._port()}")
        if attempt:   # restarted by dualrun (a server died): torchrun's own count starts again at 0
            extra[protocol.JOB_RESTARTS] = str(attempt)
        env = {**prepared.env, **extra}
        with clear_environment():   # the agent and its workers see exactly the job's env; ours comes back after
            os.environ.update(env)
            main = threading.current_thread() is threading.main_thread()
            end_job = (lambda e: _end_job(servers, e, _terminate_process_handler)) if main else (lambda _: None)
            if main:
                # torchrun's agent turns SIGTERM into SignalException and stops every worker: a dead server does that
                servers.watch(end_job)
            if self.cfg.num_machines > 1 and plan.servers:   # the machines' servers meet in torchrun's store
                share(servers, self._addr(), self._port(), end_job, attempt)
            try:
                run(args)
                servers.unwatch()   # every machine's ranks passed torchrun's exit barrier: servers may end now
                finish(servers, self._addr(), self._port())   # several machines: before this one's servers stop
            except ChildFailedError as e:
                servers.unwatch()
                if servers.settle() is not None:   # a server died first and the workers failed for it: the cause
                    return _server_died(servers, start), servers
                return _failed(e, time.monotonic() - start, self.node_workers(plan)[0].unit), servers
            except SignalException as e:
                servers.unwatch()
                if servers.failure is not None:
                    return _server_died(servers, start), servers
                return stopped_by(int(e.sigval), wall_time_s=time.monotonic() - start), servers
            except json.JSONDecodeError as e:
                # torchrun's agent reads a failed rank's error file and gives up on one cut off mid-write (torch's
                # own `@record` writes it in place, and the rank may be stopped meanwhile); its workers are stopped
                servers.unwatch()
                return JobResult(1, wall_time_s=time.monotonic() - start, message=(
                    f"a {self.node_workers(plan)[0].unit} rank failed and torchrun could not read the error file "
                    f"it left ({e}); its output above says why")), servers
            finally:
                servers.stop()
        n = len(self.node_workers(plan))
        ranks = [RankResult(p.label, p.rank, 0) for p in self.node_workers(plan)][:n]
        return JobResult(0, ranks, time.monotonic() - start), servers


def _end_job(servers: LocalServers, failure: Exception, agent_handler: Any) -> None:
    """From a watcher thread: end this attempt because of `failure`. Once the workers run, torchrun's agent turns
    SIGTERM into SignalException and stops them (the launch then names `servers.failure`). Before, its rendezvous
    may wait in C++ for another machine (no Python signal handler runs there): the error is printed, the servers
    are stopped and the launcher exits with code 1."""
    if signal.getsignal(signal.SIGTERM) is agent_handler:
        os.kill(os.getpid(), signal.SIGTERM)
        return
    print(f"dualrun: error: {failure}", file=sys.stderr, flush=True)
    servers.stop()
    os._exit(1)


def _server_died(servers: LocalServers, start: float) -> JobResult:
    """The job ended because a server died: name it, its exit code and its log's last lines."""
    return JobResult(1, wall_time_s=time.monotonic() - start, message=str(servers.failure))


def _text(message) -> str:
    if isinstance(message, dict):
        inner = message.get("message", message)
        if isinstance(inner, dict):
            return str(inner.get("message", ""))
        return str(inner)
    return str(message or "")


def _failed(e, wall: float, unit: str = "train") -> JobResult:
    """One line naming the first rank that failed by itself (exit code > 0, not one torchrun terminated
    afterwards) and the last line of its error."""
    ranks = {r: RankResult(f"{unit} rank {r}", r, f.exitcode, _text(f.message), end=f.timestamp)
             for r, f in sorted(e.failures.items())}
    own = [ranks[r] for r, f in e.failures.items() if f.exitcode is not None and f.exitcode > 0]
    return failed_job(list(ranks.values()), own, ranks[e.get_first_failure()[0]], wall)
