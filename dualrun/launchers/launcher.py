"""The launcher interface both backends implement, and what a launch returns."""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

from dualrun.contract import protocol
from dualrun.config.model import JobConfig
from dualrun.env.worker import forwarded_env
from dualrun.contract.redact import redact_argv
from dualrun.contract.errors import LaunchError, killed_by
from dualrun.contract.job_token import new_token
from dualrun.launchers.job_control import JobControl, control_for
from dualrun.plan.processes import AUTO, Cluster, Plan
from dualrun.plan.meeting import Rendezvous, rendezvous_of
from dualrun.servers.serverset import ServerDeath, ServerSet


@dataclass(frozen=True)
class Program:
    """What the workers run: a script path or `-m module`, with the user's own arguments."""

    target: str
    args: tuple[str, ...] = ()
    module: bool = False
    call_file: str | None = None   # Python API: a pickled function instead of a script

    def bootstrap_argv(self) -> list[str]:
        if self.call_file:
            return ["--call", self.call_file]
        return (["-m", self.target] if self.module else [self.target]) + list(self.args)


@dataclass(frozen=True)
class Prepared:
    """One launch, prepared before anything starts: `--dry_run` prints this object (`Launcher.describe`) and
    `Launcher.launch` runs this same object, so the two cannot drift (TorchX's `submit_dryrun` shape). Values only
    the running launch knows (a Ray rank's node, its GPUs, a server's port) are `<auto>`."""

    plan: Plan | None
    argv: tuple[str, ...]             # what each worker runs (torchrun: this node's torchrun; roles: the driver)
    env: Mapping[str, str]            # its env (Ray: the part every rank shares; each rank's is in `rank_envs`)
    cwd: str
    rank_envs: Mapping[str, Mapping[str, str]] = field(default_factory=dict)   # Ray: label -> the rank's env
    servers: tuple[tuple[str, tuple[str, ...], Mapping[str, str]], ...] = ()   # label, command, env shown


@dataclass
class RankResult:
    label: str
    rank: int
    exit_code: int
    error: str | None = None
    result: Any = None
    end: float | None = None       # when it ended (wall clock), for naming the rank that failed first


SLOW_STOP_S = 3.0   # a job's end whose stop took longer says what took the time (`JobResult.stop_line`)


@dataclass
class JobResult:
    exit_code: int
    ranks: list[RankResult] = field(default_factory=list)
    wall_time_s: float = 0.0
    message: str | None = None     # one line naming the failing rank and its error
    restarts: int = 0
    fleet: list[str] = field(default_factory=list)   # each change of a fleet while the job ran (the summary's)
    stopping: dict[str, float] = field(default_factory=dict)   # what the job's end stopped -> seconds it took

    def stop_line(self) -> str | None:
        """The summary's line for a stop slower than SLOW_STOP_S, part by part (None when it was not): a job
        that took long to end says where the time went."""
        took = sum(self.stopping.values())
        if took <= SLOW_STOP_S:
            return None
        parts = ", ".join(f"{what} {seconds:.1f} s" for what, seconds in self.stopping.items() if seconds >= 0.05)
        return f"stopping took {took:.1f} s ({parts})"

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


@dataclass(frozen=True)
class Outcome:
    """What one attempt came to: its result; why the job restarts ("X; restarting the job"; None: it does not,
    each backend says which failures it restarts itself: torchrun restarts its workers on its own); and the
    servers whose death ended it (the next attempt then gets a fresh server set)."""

    result: JobResult
    restart: str | None = None
    dead: tuple[ServerDeath, ...] = ()


class Launcher(ABC):
    """`launch(plan) -> JobResult`. Cluster facts stay in the Plan; the launcher only runs it."""

    name = "base"

    def __init__(self, job: "Rendezvous | JobConfig", program: Program,
                 accelerate_env: Mapping[str, str] | None = None, plugin: Any = None) -> None:
        """`job`: the rendezvous the plan carries (plan/meeting.py; a config is read into one here): all the
        launcher knows of the config. What it runs comes with the plan (`prepare`)."""
        self.rdzv = job if isinstance(job, Rendezvous) else rendezvous_of(job)
        self.program = program
        self.accelerate_env = dict(accelerate_env or {})
        self.plugin = plugin
        self.run_id = f"dualrun-{uuid.uuid4().hex[:10]}"
        self.job_token = job_token_for(self.rdzv)
        self._starting: threading.Event | None = None   # side by side: set once the servers' start has ended
        self.stopping: dict[str, float] = {}   # the last stop of each part ("the ranks", ...) -> seconds it took
        self.token_given = bool(os.environ.get(protocol.JOB_TOKEN))   # the user's: never handed to other machines

    def cluster(self) -> "Cluster | None":
        """The live cluster to plan onto (None: the one the config implies). May connect; never at dry run."""
        return None

    def close(self) -> None:
        """Release what the launcher holds (a Ray connection, an embedded cluster). Idempotent."""

    @abstractmethod
    def prepare(self, plan: Plan | None) -> Prepared:
        """The commands and env of the launch (starts nothing): what `describe` prints and `launch` runs."""

    def launch(self, prepared: Prepared) -> JobResult:
        """Run the prepared launch to completion (or failure); never leaves a process behind.

        One sequence and one restart policy for every backend: the job's servers (`server_set`) start, beside the
        trainers where the set can hand out its addresses first (`start_servers`); each attempt runs the workers to
        their end (`run_attempt`); while an attempt's outcome names a restart cause the whole job restarts, up to
        max_failures times. A server set lives until one of its servers dies: then the next attempt gets a fresh
        set that never reuses an endpoint of an earlier one. Servers that never started end the job (nothing to
        restart), named, whether the trainers were already running or not."""
        start = time.monotonic()
        attempt = 0
        avoid: set[str] = set()   # endpoints of the sets replaced so far
        servers: ServerSet | None = None
        control: JobControl | None = None   # `dualrun scale`'s channel to the servers' fleet, while they run
        changes: list[str] = []             # the fleets' changes, every server set's
        with self.session(), _in_environ(protocol.JOB_TOKEN, self.job_token):   # the launcher's router calls carry it
            try:
                while True:
                    if servers is None:
                        servers = self.server_set(prepared.plan, attempt, frozenset(avoid))
                        failed = self.start_servers(servers, prepared.plan)
                        if failed is not None:
                            result = failed
                            break
                        control = control_for(self.run_id, self.job_token, servers, _config_path(self.rdzv))
                    outcome = self.run_attempt(prepared, attempt, servers)
                    result = outcome.result
                    if result.ok and self._starting is not None:   # the ranks ended before the servers answered:
                        self._starting.wait()                     # a server that cannot start still fails the job
                    never = getattr(servers, "start_error", None)
                    if never is not None:   # side by side: the servers never all answered; the ranks were stopped
                        result = JobResult(getattr(never, "exit_code", 1), result.ranks, message=str(never))
                        break
                    if outcome.restart is None or attempt >= self.rdzv.max_failures:
                        break
                    attempt += 1
                    print(f"dualrun: {outcome.restart} ({attempt}/{self.rdzv.max_failures})", file=sys.stderr,
                          flush=True)
                    if outcome.dead and servers is not None:   # fresh servers; never the dead one's address
                        avoid |= servers.used()
                        changes += getattr(servers, "fleet_history", [])
                        control = _stopped(control)
                        servers.stop(self.server_grace_s(restarting=True))
                        servers = None
                    prepared = self.before_restart(prepared, attempt)
            finally:
                _stopped(control)   # `dualrun scale` reaches the job no more: its registry file goes first
                if servers is not None:   # servers go with the job
                    changes += getattr(servers, "fleet_history", [])
                    began = time.monotonic()
                    servers.stop(self.server_grace_s(restarting=False))
                    self.stopping["the servers"] = time.monotonic() - began
        result.restarts = attempt
        result.fleet = changes
        result.stopping = dict(self.stopping)
        result.wall_time_s = time.monotonic() - start
        return result

    def session(self) -> "contextlib.AbstractContextManager[Any]":
        """What spans every attempt (a Ray connection, signal handlers)."""
        return contextlib.nullcontext()

    def server_set(self, plan: Plan | None, attempt: int, avoid: frozenset[str]) -> ServerSet | None:
        """The plan's servers for `attempt` (not started), never on an endpoint in `avoid`; None: the launcher
        starts no servers."""
        return None

    def start_servers(self, servers: ServerSet | None, plan: Plan | None) -> JobResult | None:
        """Start `servers`: beside the workers where the set fixes its addresses first (`reserve`; the ranks wait
        for a server where they first use it, as TRL's client does), else before any worker. None once started
        (side by side: once begun), else the job's result (a LaunchError naming the server)."""
        if servers is None or plan is None:
            return None
        began = time.monotonic()
        try:
            reserved = servers.reserve()
            if reserved is not None:
                report_servers(servers.addresses, plan.external, starting=True)
                self._starting = threading.Event()   # set once the start has ended, either way
                threading.Thread(target=self._start_beside, args=(servers, plan, began),
                                 name="dualrun-server-start", daemon=True).start()
                return None
            servers.start()
        except LaunchError as e:
            self.servers_not_started(servers, e)
            return JobResult(e.exit_code, message=str(e))
        report_servers(servers.addresses, plan.external, seconds=time.monotonic() - began)
        return None

    def _start_beside(self, servers: ServerSet, plan: Plan, began: float) -> None:
        """The servers' start while the workers start (a thread of its own): the line once they all answer, or the
        job ended naming the one that did not (`not_started`: the attempt's watchers stop the ranks)."""
        settled = self._starting
        try:
            servers.start()
        except BaseException as e:   # noqa: BLE001 - every way the start can end must reach the job
            if not (servers.stopping or self.signalled()):   # else the job ended meanwhile, or a signal ends it
                error = e if isinstance(e, LaunchError) else LaunchError(
                    f"the servers did not start: {type(e).__name__}: {e}")
                self.servers_not_started(servers, error)
                servers.not_started(error)
            if settled is not None:
                settled.set()
            return
        if not servers.stopping:
            servers.started_all()
            report_servers(servers.addresses, plan.external, seconds=time.monotonic() - began)
        if settled is not None:
            settled.set()
        # a server started here dies with the thread that spawned it (PR_SET_PDEATHSIG): this one stays till the end
        servers.wait_stopped()

    def signalled(self) -> bool:
        """Whether a signal is ending the launch (a backend that defers signals says so)."""
        return False

    def servers_not_started(self, servers: ServerSet, error: LaunchError) -> None:
        """What else a launch does when its servers did not start (nothing by default)."""

    def server_grace_s(self, restarting: bool) -> float:
        """SIGTERM -> SIGKILL grace for a server set: the job ends (or restarts with fresh servers)."""
        return 10.0

    @abstractmethod
    def run_attempt(self, prepared: Prepared, attempt: int, servers: ServerSet | None) -> Outcome:
        """One attempt: the workers, to their end, beside the running `servers`; stops what it alone owns."""

    def before_restart(self, prepared: Prepared, attempt: int) -> Prepared:
        """What restart `attempt` runs (a fresh rendezvous port, say); the same launch by default."""
        return prepared

    @abstractmethod
    def describe(self, prepared: Prepared) -> str:
        """The prepared commands and env (secrets redacted), for --dry_run."""

    def omp_threads(self, per_node: int) -> str | None:
        """torchrun's OMP_NUM_THREADS rule, for every backend: the launching env's value, else 1 when a node runs
        more than one process (else unset: torch picks)."""
        if "OMP_NUM_THREADS" in os.environ:
            return os.environ["OMP_NUM_THREADS"]
        return "1" if per_node > 1 else None

    def worker_env(self, process_env: Mapping[str, str], base: Mapping[str, str] | None = None,
                   **fill: str) -> dict[str, str]:
        """Allow-listed launching env < accelerate's env < the plan's env, with `<auto>` values filled."""
        env = forwarded_env() if base is None else dict(base)
        # a rank's or server's output goes to a pipe (a Ray actor reads it; torchrun's agent with log_dir; `| tee`),
        # where Python buffers stdout in blocks: a rank's prints reached the console only at its exit. Line by line,
        # as on a terminal, unless the user's env says otherwise.
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.update(self.accelerate_env)
        env.update(process_env)
        fill.setdefault(protocol.RUN_ID, self.run_id)
        fill.setdefault(protocol.JOB_TOKEN, self.job_token)
        fill.setdefault("TORCHELASTIC_RUN_ID", self.run_id)
        for key, value in fill.items():
            if env.get(key) == AUTO or key in (protocol.RUN_ID, protocol.JOB_TOKEN):
                env[key] = value
        return env


@contextlib.contextmanager
def _in_environ(name: str, value: str) -> "Iterator[None]":
    """`name=value` in this process's env while inside, then as it was."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _stopped(control: JobControl | None) -> None:
    """Stop a job's control channel, if any (its registry file removed); None, the channel there is now."""
    if control is not None:
        control.stop()
    return None


def _config_path(rdzv: Rendezvous) -> str:
    """The config file as `dualrun scale` lists it: absolute where it is a file."""
    return os.path.abspath(rdzv.source) if rdzv.source and os.path.isfile(rdzv.source) else rdzv.source


def job_token_for(rdzv: Rendezvous) -> str:
    """The job's secret: the launching env's DUALRUN_JOB_TOKEN, else a fresh one; on torchrun's machines 1..N
    (started by hand, each its own launcher) "" until the launch reads machine 0's from its store
    (`servers.machines.take_token`)."""
    given = os.environ.get(protocol.JOB_TOKEN)
    if given:
        return given
    return "" if rdzv.per_machine and rdzv.several and rdzv.machine_rank else new_token()


def failed_job(ranks: list[RankResult], own: list[RankResult], fallback: RankResult, wall_time_s: float = 0.0) -> JobResult:
    """One line naming the root cause: of the ranks that failed by themselves (`own`, not the ones the launcher
    stopped afterwards) the first to end, else `fallback`; its exit code, and its error's last line."""
    culprit = min(own, key=lambda r: (r.end or 0.0, r.rank)) if own else fallback
    code = culprit.exit_code
    detail = (culprit.error or "").strip().splitlines()
    tail = killed_by(code) or (detail[-1] if detail else "no error message")
    return JobResult(code if code and code > 0 else 1, ranks, wall_time_s,
                     message=f"{culprit.label} failed (exit code {code}): {tail}")


def stopped_by(signum: int, what: str = "every worker of the job was terminated", wall_time_s: float = 0.0) -> JobResult:
    """The result of a job a signal ended: the shell's code for it (128 + N: 130 for SIGINT, 143 for SIGTERM)."""
    import signal

    return JobResult(128 + signum, wall_time_s=wall_time_s, message=f"stopped by {signal.Signals(signum).name}: {what}")


def report_servers(addresses: Mapping[str, str], external: Mapping[str, str], seconds: float | None = None,
                   starting: bool = False) -> None:
    """A live line per separate role: its server starting beside the trainers (`starting`), or answering after
    `seconds` (user-run ones are only named, once)."""
    for role, addr in addresses.items():
        if role in external:
            if not starting:
                print(f"dualrun: {role}: user-run server at {addr}", file=sys.stderr, flush=True)
        elif starting:
            print(f"dualrun: {role}: server starting at {addr}; the trainers start beside it", file=sys.stderr,
                  flush=True)
        else:
            took = f" (started in {seconds:.1f} s)" if seconds is not None else ""
            print(f"dualrun: {role}: server healthy at {addr}{took}", file=sys.stderr, flush=True)


def bootstrap_module_argv(program: Program) -> list[str]:
    """`-m dualrun.rank.bootstrap ...`: what every worker runs, after an interpreter (or torchrun's own arguments)."""
    return ["-m", "dualrun.rank.bootstrap"] + program.bootstrap_argv()


def bootstrap_cmd(program: Program, python: str | None = None) -> list[str]:
    """The whole command of a worker: `python` (default: this interpreter) running the bootstrap."""
    import sys

    return [python or sys.executable] + bootstrap_module_argv(program)


def cwd() -> str:
    return os.getcwd()


def join_cmd(cmd: Sequence[str]) -> str:
    import shlex

    return " ".join(shlex.quote(c) for c in cmd)


def server_preview_line(shown: Mapping[str, str], argv: Sequence[str]) -> str:
    """A dry run's view of one server, the same on every backend: the env it adds, then its command, secrets
    redacted."""
    return " ".join(f"{k}={v}" for k, v in shown.items()) + " " + join_cmd(redact_argv(list(argv)))
