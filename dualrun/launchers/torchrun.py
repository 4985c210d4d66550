"""torchrun backend: runs torch.distributed.run for this node, in this process, like `accelerate launch`.

Multi-node is by hand, as with accelerate: the same command on every node with `--machine_rank` and
`--main_process_ip`. Workers get the allow-listed launching env, accelerate's env for the config and the plan's
env; torchrun adds the rank variables itself.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Mapping

from dualrun import protocol
from dualrun.envspec import TORCHRUN_NAMES, redact, redact_argv
from dualrun.errors import LaunchError, killed_by
from dualrun.launchers.base import (JobResult, Launcher, RankResult, bootstrap_module_argv, join_cmd,
                                    report_servers)
from dualrun.plan import AUTO, Plan
from dualrun.ports import free_port
from dualrun.servers.commands import ROLLOUT_SERVER_ENV
from dualrun.servers.local import LocalServers, server_command


class TorchrunLauncher(Launcher):
    name = "torchrun"

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

    def agent_env(self, plan: Plan, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The env torchrun (and so every worker) starts with; torchrun adds the rank variables."""
        first = self.node_workers(plan)[0]
        env = self.worker_env(first.env, MASTER_ADDR=self._addr(), MASTER_PORT=str(self._port()))
        for name in TORCHRUN_NAMES:
            if name in first.env:
                env.pop(name, None)
        if "OMP_NUM_THREADS" in os.environ:
            env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
        env.update(extra or {})
        return {k: v for k, v in env.items() if v != AUTO}

    def describe(self, plan: Plan) -> str:
        env = redact(self.agent_env(plan))
        lines = [f"# dualrun dry run: backend=torchrun, machine_rank {self.cfg.machine_rank} of "
                 f"{self.cfg.num_machines}; nothing was started",
                 f"cd {join_cmd([os.getcwd()])}",
                 "env -i \\"]
        lines += [f"  {k}={join_cmd([v])} \\" for k, v in sorted(env.items())]
        lines.append("  " + join_cmd([sys.executable, "-m", "torch.distributed.run"] + self.torchrun_argv(plan)))
        for p in reversed(plan.servers):  # started first (in plan order: replicas, then their router); free ports
            if p.node == self.cfg.machine_rank:
                argv = server_command(self.cfg, self.plugin, p, "127.0.0.1", AUTO)  # type: ignore[arg-type]
                shown = {"CUDA_VISIBLE_DEVICES": p.env.get("CUDA_VISIBLE_DEVICES", "")}
                shown.update({k: p.env[k] for k in ROLLOUT_SERVER_ENV if k in p.env})
                lines.insert(2, f"# {p.label}, started first: " + " ".join(f"{k}={v}" for k, v in shown.items())
                             + " " + join_cmd(redact_argv(argv)))
        return "\n".join(lines)

    def launch(self, plan: Plan) -> JobResult:
        """Run torchrun for this node; a server that dies ends the job (or, with max_failures, restarts it with
        fresh servers on fresh ports: torchrun restarts the workers, dualrun the servers)."""
        start = time.monotonic()
        used_ports: set[int] = set()
        attempt = 0
        while True:
            result, servers = self._attempt(plan, attempt, used_ports)
            used_ports |= servers.ports_used
            if servers.failure is None or attempt >= self.cfg.max_failures:
                break
            attempt += 1
            print(f"dualrun: {servers.failure.one_line()}; restarting the job with fresh servers "
                  f"({attempt}/{self.cfg.max_failures})", file=sys.stderr, flush=True)
            if self.cfg.main_process_port is None and self.cfg.num_machines == 1:
                self.__dict__.pop("_chosen_port", None)   # a fresh rendezvous port too
        result.restarts = attempt
        result.wall_time_s = time.monotonic() - start
        return result

    def _attempt(self, plan: Plan, attempt: int, used_ports: set[int]) -> "tuple[JobResult, LocalServers]":
        from accelerate.utils import clear_environment
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import parse_args, run

        start = time.monotonic()
        # separate roles: their servers start first (on their own devices), the trainers get their addresses
        servers = LocalServers(self.cfg, self.plugin, plan, lambda p: self.worker_env(p.env), avoid_ports=used_ports)
        try:
            servers.start()
            report_servers(servers.addresses, plan.external)
        except LaunchError as e:
            return JobResult(e.exit_code, wall_time_s=time.monotonic() - start, message=str(e)), servers
        # the script's own arguments bypass torchrun's parser: `--n` must not match torchrun's `--nnodes`
        argv = self.torchrun_argv(plan)
        script_args = self.program.bootstrap_argv()
        args = parse_args(argv[: len(argv) - len(script_args)])
        args.training_script_args = script_args
        args.max_restarts = max(0, self.cfg.max_failures - attempt)   # one budget for worker and server failures
        extra = servers.wiring_env()
        if attempt:   # restarted by dualrun (a server died): torchrun's own count starts again at 0
            extra[protocol.JOB_RESTARTS] = str(attempt)
        env = self.agent_env(plan, extra=extra)
        with clear_environment():   # the agent and its workers see exactly the job's env; ours comes back after
            os.environ.update(env)
            if threading.current_thread() is threading.main_thread():
                # torchrun's agent turns SIGTERM into SignalException and stops every worker: a dead server does that
                servers.watch(lambda _: os.kill(os.getpid(), signal.SIGTERM))
            try:
                run(args)
            except ChildFailedError as e:
                servers.unwatch()
                if servers.check() is not None:   # a server died first and the workers failed for it: the cause
                    return _server_died(servers, start), servers
                return _failed(e, time.monotonic() - start, self.node_workers(plan)[0].unit), servers
            except SignalException as e:
                servers.unwatch()
                if servers.failure is not None:
                    return _server_died(servers, start), servers
                code = 128 + int(e.sigval)
                name = signal.Signals(e.sigval).name
                return JobResult(code, wall_time_s=time.monotonic() - start,
                                 message=f"stopped by {name}: every worker of the job was terminated"), servers
            finally:
                servers.stop()
        n = len(self.node_workers(plan))
        ranks = [RankResult(p.label, p.rank, 0) for p in self.node_workers(plan)][:n]
        return JobResult(0, ranks, time.monotonic() - start), servers


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
    """One line naming the first rank that failed and the last line of its error."""
    ranks = [RankResult(f"{unit} rank {r}", r, f.exitcode, _text(f.message)) for r, f in sorted(e.failures.items())]
    # the root cause: a rank that failed by itself (exit code > 0), not one torchrun terminated afterwards
    own = [(f.timestamp, r, f) for r, f in e.failures.items() if f.exitcode is not None and f.exitcode > 0]
    if own:
        _, rank, failure = min(own, key=lambda t: (t[0], t[1]))
    else:
        rank, failure = e.get_first_failure()
    code = failure.exitcode if failure.exitcode and failure.exitcode > 0 else 1
    detail = _text(failure.message).strip().splitlines()
    tail = detail[-1] if detail else "no error message"
    tail = killed_by(failure.exitcode) or tail
    return JobResult(code, ranks, wall, message=f"{unit} rank {rank} failed (exit code {failure.exitcode}): {tail}")
