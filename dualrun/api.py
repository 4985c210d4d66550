"""Run a validated job: pick the launcher, plan, (dry-)run, summarise. Shared by the CLI and `dualrun.launch`."""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Mapping, Sequence, TextIO

from dualrun.config.load import errors_as_written
from dualrun.config.model import JobConfig
from dualrun.contract.errors import ConfigError, killed_by, mark_started
from dualrun.backends import backend_of
from dualrun.launchers import JobResult, Program, RankResult
from dualrun.plan.processes import make_plan
from dualrun.methods.plugin import MethodPlugin


def _accelerate_env(cfg: JobConfig) -> dict[str, str]:
    from dualrun.launchers.accelerate_env import cached_accelerate_env

    try:
        return cached_accelerate_env(cfg)
    except Exception as e:  # noqa: BLE001 - accelerate refuses configs with many kinds of error (fp8 without its
        # backend raises ImportError/RuntimeError): every one is about the accelerate keys
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(cfg.source, "accelerate keys", "a config accelerate accepts", msg) from None


def run_job(cfg: JobConfig, program: Program, plugin: MethodPlugin, dry_run: bool = False,
            out: TextIO | None = None) -> JobResult:
    """Check, place and launch a loaded job. Every config error on the way (the program's checks, the placement,
    the pre-flight) names the ms-swift `device_groups` key the user wrote, where a role came from one."""
    with errors_as_written(cfg.written_as):
        return _run_job(cfg, program, plugin, dry_run, out)


def _run_job(cfg: JobConfig, program: Program, plugin: MethodPlugin, dry_run: bool,
             out: TextIO | None) -> JobResult:
    out = out or sys.stderr
    started = time.monotonic()
    from dualrun.role_programs.driver import is_role_job

    if is_role_job(program, plugin):  # a role program (docs/roles.md): once, as the driver of its groups
        return _run_role_driver(cfg, program, plugin, dry_run)
    plugin.check_program(cfg, program)   # what the program cannot do with this layout (read, never run)
    backend = backend_of(cfg)
    launcher = backend.launcher(cfg, program, plugin)
    # bad input fails before torch is imported for accelerate's env (seconds): the placement on the cluster the
    # config implies (dry runs, and a backend that does not plan onto a live cluster, plan on nothing else), and
    # what the backend checks first (an unreachable Ray address)
    early = make_plan(cfg, method=plugin, environ=os.environ) if dry_run or not backend.plans_live else None
    if not dry_run:
        plugin.preflight(cfg)   # what this environment lacks (e.g. vLLM for GRPO's rollout), before anything starts
        backend.before_launch(cfg)
    if dry_run:
        launcher.accelerate_env = _accelerate_env(cfg)
        cluster = None
    else:
        # accelerate's env needs torch imported (~2-3 s); Ray needs its cluster joined or started: overlap them
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1, thread_name_prefix="dualrun-accelerate-env") as pool:
            pending = pool.submit(_accelerate_env, cfg)
            mark_started()
            try:
                cluster = launcher.cluster()
                launcher.accelerate_env = pending.result()
            except BaseException:
                launcher.close()
                raise
    try:   # a plan that does not fit the live cluster is refused: the cluster joined or started is released too
        plan = early if cluster is None and early is not None else make_plan(cfg, cluster, plugin, environ=os.environ)
        prepared = launcher.prepare(plan)   # what the dry run prints is what the launch runs
        if dry_run:
            print(plan.table(), file=sys.stdout)
            print(launcher.describe(prepared), file=sys.stdout)
            _note_dropped_env(cfg, out)
            return JobResult(0)
        print(f"dualrun: {plan.table()}", file=out, flush=True)
        _note_dropped_env(cfg, out)   # only once the job is valid: a bad input stays one line
        print(f"dualrun: {_startup_line(cfg, plan)}", file=out, flush=True)
        result = launcher.launch(prepared)
        _summarise(result, started, out)
    finally:
        launcher.close()   # after the summary: shutting an embedded Ray down takes a second or two
    return result


def _run_role_driver(cfg: JobConfig, program: Program, plugin: MethodPlugin, dry_run: bool) -> JobResult:
    """A role program: one driver process, no plan of ranks and no accelerate env of its own to prepare."""
    from dualrun.launchers.role_program import RoleDriverLauncher
    from dualrun.role_programs.driver import check_role_job

    check_role_job(cfg)
    launcher = RoleDriverLauncher(cfg, program, plugin=plugin)
    prepared = launcher.prepare()
    if dry_run:
        print(launcher.describe(prepared), file=sys.stdout)
        return JobResult(0)
    mark_started()
    return launcher.launch(prepared)


def _note_dropped_env(cfg: JobConfig, out: TextIO) -> None:
    """`MY_FLAG=1 dualrun launch ...`: name (never print values of) what will not reach the workers."""
    from dualrun.env.unforwarded import dropped_line

    given = set(cfg.env) | {k for r in cfg.roles for k in r.env}
    line = dropped_line({k: v for k, v in os.environ.items() if k not in given})
    if line:
        print(f"dualrun: {line}", file=out, flush=True)


def _summarise(result: JobResult, started: float, out: TextIO) -> None:
    status = "succeeded" if result.ok else f"failed (exit code {result.exit_code})"
    total = time.monotonic() - started
    print(f"dualrun: job {status} in {total:.1f} s (workers {result.wall_time_s:.1f} s)"
          + (f" after {result.restarts} restart(s)" if result.restarts else ""), file=out, flush=True)
    slow = result.stop_line()
    if slow:
        print(f"dualrun: {slow}", file=out, flush=True)
    if result.fleet:
        print(f"dualrun: fleet: {'; '.join(result.fleet)}", file=out, flush=True)
    if result.ranks:
        ranks = ", ".join(f"{r.label}: {_exit_word(r.exit_code)}" for r in sorted(result.ranks, key=lambda r: r.rank))
        print(f"dualrun: {ranks}", file=out, flush=True)
    if result.message and not result.ok:
        print(f"dualrun: error: {result.message}", file=out, flush=True)
    result.wall_time_s = total


def _startup_line(cfg: JobConfig, plan: Any) -> str:
    """What starts and where its output goes, before anything starts."""
    units: dict[str, int] = {}
    for p in plan.processes:
        key = f"{p.unit} {p.kind}"   # worker, server (an engine replica) or router
        units[key] = units.get(key, 0) + 1
    what = ", ".join(f"{n} {u}{'s' if n > 1 else ''}" for u, n in units.items())
    logs = f"output prefixed per rank, also in {cfg.log_dir}/<role>_<rank>.log" if cfg.log_dir else \
        backend_of(cfg).output
    return f"starting {what} on {cfg.backend}; {logs}"


def _exit_word(code: int | None) -> str:
    if code == 0:
        return "ok"
    return killed_by(code) or f"exit {code}"


def launch(target: "str | Callable[..., Any]", args: Sequence[str] = (), *, config: "str | Mapping[str, Any] | JobConfig | None" = None,
           backend: str | None = None, module: bool = False, fn_args: tuple = (), fn_kwargs: dict | None = None,
           dry_run: bool = False, **overrides: Any) -> JobResult:
    """Run a script (path, or module with `module=True`) or a function on every worker; wait; return the result.

    `config` is a YAML path, a dict of config keys, or a JobConfig; `overrides` use accelerate's names
    (`num_processes=2`, ...). For a function, `JobResult.ranks[i].result` holds rank i's return value
    (it must be picklable). Raises nothing for a failed job: check `result.ok` / `result.message`.
    """
    import tempfile

    from dualrun.config import build_config, load_config
    from dualrun.config.environment import check_environment
    from dualrun.contract.calls import load_results, save_call
    from dualrun.methods.plugin import get_plugin, validate

    if isinstance(config, JobConfig):
        cfg = config
        if backend or overrides:
            raise ValueError("pass overrides inside the JobConfig, or pass config as a path or dict")
    elif isinstance(config, Mapping):
        cfg = build_config(config, "<python>", overrides, backend)
    else:
        cfg = load_config(config, overrides, backend)
    check_environment(backend=cfg.backend)
    plugin = get_plugin(cfg.method, cfg.source)
    validate(cfg, plugin)
    if callable(target):
        with tempfile.TemporaryDirectory(prefix="dualrun-call-") as tmp:
            call_file = os.path.join(tmp, "call.pkl")
            save_call(call_file, target, fn_args, fn_kwargs)
            program = Program(getattr(target, "__name__", "function"), call_file=call_file)
            result = run_job(cfg, program, plugin, dry_run=dry_run)
            values = load_results(call_file)
        by_rank = {r.rank: r for r in result.ranks}
        for rank, value in sorted(values.items()):
            if rank in by_rank:
                by_rank[rank].result = value
            else:
                result.ranks.append(RankResult(f"rank {rank}", rank, 0, result=value))
        result.ranks.sort(key=lambda r: r.rank)
        return result
    if not module and not os.path.isfile(target):
        raise ConfigError("<python>", "target", "an existing script file", target)
    return run_job(cfg, Program(target, tuple(args), module), plugin, dry_run=dry_run)
