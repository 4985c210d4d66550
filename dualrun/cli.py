"""`dualrun` command line: launch | plan | check | config [default] | env | scale.

Bad input ends with exit code 2 and one line on stderr (file, key, what was expected); nothing is started.
"""
from __future__ import annotations

import argparse
import errno
import os
import re
import sys
from typing import Any, Sequence

from dualrun.contract import protocol
from dualrun.contract.errors import ConfigError, DualrunError, Said, one_line

OVERRIDE_FLAGS = (("--num_processes", int), ("--num_machines", int), ("--machine_rank", int),
                  ("--main_process_ip", str), ("--main_process_port", int), ("--mixed_precision", str))


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, like every other bad input
        from dualrun.contract.redact import redact_text

        sys.stderr.write(one_line(redact_text(f"{self.prog}: error: {message}")) + "\n")
        sys.exit(2)


def _job_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config_file", "--config-file", dest="config_file", default=None,
                   help="YAML config: accelerate keys plus dualrun's (backend, method, roles, ...)")
    p.add_argument("--backend", default=None, help="torchrun, ray, or any installed backend (overrides the file)")
    for flag, kind in OVERRIDE_FLAGS:
        p.add_argument(flag, flag.replace("_", "-"), dest=flag[2:], type=str, default=None,
                       help=f"accelerate's {flag[2:]} (overrides the file)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dualrun", description="Run Hugging Face / TRL training scripts on torchrun or Ray.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)

    launch = sub.add_parser("launch", help="run a training script on the chosen backend", allow_abbrev=False)
    _job_flags(launch)
    launch.add_argument("--dry_run", "--dry-run", dest="dry_run", action="store_true",
                        help="print the exact commands and env (secrets redacted); start nothing")
    launch.add_argument("--submit", action="store_true",
                        help="submit the job to the backend's batch scheduler (slurm: sbatch, from a login node), "
                             "follow its output and exit with its code")
    launch.add_argument("-m", "--module", action="store_true", help="run the target as a module (python -m)")
    launch.add_argument("training_script", help="the script (or module with -m) every worker runs")
    script_args = launch.add_argument("training_script_args", nargs=argparse.REMAINDER,
                                      help="the script's own arguments")
    script_args.required = False   # argparse marks a REMAINDER positional required; none at all is fine

    plan = sub.add_parser("plan", help="print which GPU runs which role and rank", allow_abbrev=False)
    _job_flags(plan)
    plan.add_argument("--json", action="store_true", help="machine-readable plan")

    config = sub.add_parser("config", help="ask a few questions and write the config (as `accelerate config`); "
                            "`config default`: a starter config without questions", allow_abbrev=False)
    config.add_argument("--config_file", "--config-file", dest="ask_config_file", default=None, metavar="PATH",
                        help="where to write it (default dualrun.yaml; an existing file only if you answer yes)")
    csub = config.add_subparsers(dest="config_command", parser_class=_Parser)
    default = csub.add_parser("default", help="write a starter config (never overwrites)", allow_abbrev=False)
    default.add_argument("path", nargs="?", default=None, help="where to write it (default dualrun.yaml)")
    default.add_argument("--config_file", "--config-file", dest="config_file", default=None,
                         help="accelerate's spelling of the path")
    default.add_argument("--method", default="sft", choices=("sft", "pt", "grpo", "gkd"))
    default.add_argument("--cpu", action="store_true", help="a CPU config (gloo, no GPUs)")

    check = sub.add_parser("check", help="pre-flight: every node's versions, directory, GPUs, ports, addresses, and "
                           "the trainer's weight-sync group", allow_abbrev=False)
    _job_flags(check)
    check.add_argument("--wait_s", "--wait-s", dest="wait_s", type=float, default=None,
                       help="several torchrun machines: how long each waits for the others to run the check too "
                            "(default 120)")

    sub.add_parser("env", help="versions, devices and whether a Ray cluster is reachable")

    scale = sub.add_parser("scale", help="resize a running job's fleet (a role with max_replicas above "
                           "min_replicas) on the machine that launched it", allow_abbrev=False)
    scale.add_argument("role", metavar="ROLE", help="the role to resize (rollout, teacher, ...)")
    scale.add_argument("replicas", metavar="N", type=_replica_count, help="how many replicas it should run")
    scale.add_argument("--job", default=None, metavar="RUN_ID",
                       help="which job (the id its launch printed); needed when several run")
    return parser


def _replica_count(text: str) -> int:
    """`dualrun scale`'s N: an integer >= 0 (bounded: int() of a huge string takes seconds)."""
    if not re.fullmatch(r"\d{1,9}", text.strip()):
        raise argparse.ArgumentTypeError(f"expected a number of replicas (an integer >= 0), got {one_line(text, 40)!r}")
    return int(text)


def _overrides(ns: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for flag, kind in OVERRIDE_FLAGS:
        value = getattr(ns, flag[2:], None)
        if value is None:
            continue
        if kind is int:
            if not re.fullmatch(r"\s*-?\d{1,30}\s*", value):   # bounded: int() of 10^6 digits takes seconds
                raise ConfigError("<command line>", flag, "an integer", value)
            value = int(value)
        out[flag[2:]] = value
    return out


def _load(ns: argparse.Namespace):
    from dualrun.config import load_config
    from dualrun.methods.plugin import get_plugin, validate

    from dualrun.config.environment import check_environment

    cfg = load_config(ns.config_file, _overrides(ns), ns.backend)
    check_environment(backend=cfg.backend)
    plugin = get_plugin(cfg.method, cfg.source)
    validate(cfg, plugin)
    return cfg, plugin


def cmd_plan(ns: argparse.Namespace) -> int:
    cfg, plugin = _load(ns)
    if getattr(plugin, "single_controller", False):   # what runs is the driver and its groups, not ranks
        return _plan_role_program(cfg, ns.json)
    from dualrun.backends import backend_of

    plan = _plan_of(cfg, plugin)
    if ns.json:
        print(plan.to_json())
        return 0
    print(plan.table())
    for line in backend_of(cfg).plan_notes(cfg, plan):
        print(line)
    return 0


def _plan_of(cfg: Any, plugin: Any) -> Any:
    """The plan `dualrun plan` prints (a ConfigError for a layout it refuses)."""
    from dualrun.backends import backend_of
    from dualrun.config.load import errors_as_written
    from dualrun.plan.processes import make_plan

    with errors_as_written(cfg.written_as):
        return make_plan(cfg, backend_of(cfg).plan_cluster(cfg), environ=os.environ, method=plugin)


def _plan_role_program(cfg: Any, as_json: bool) -> int:
    """A single-controller method (docs/roles.md): the one driver and each group's workers, as a launch starts."""
    import json
    from dataclasses import asdict

    from dualrun.role_programs.driver import check_role_job, roles_mode
    from dualrun.role_programs.modes import groups_table
    from dualrun.role_programs.spec import spec_from_config

    check_role_job(cfg)
    spec = spec_from_config(cfg)
    if as_json:
        print(json.dumps({"backend": cfg.backend, "method": cfg.method, "config": cfg.source, "role_program": {
            "runs": "once, as the driver", "groups_mode": roles_mode(cfg),
            "groups": [asdict(g) for g in spec.groups]}}, indent=2))
    else:
        print(groups_table(spec, roles_mode(cfg)))
    return 0


def cmd_launch(ns: argparse.Namespace) -> int:
    from dualrun.api import run_job
    from dualrun.launchers.launcher import Program

    cfg, plugin = _load(ns)
    program = Program(ns.training_script, tuple(ns.training_script_args), ns.module)
    if ns.module:
        from dualrun.config.program import check_module

        check_module(cfg, ns.training_script)
    elif not os.path.isfile(ns.training_script):
        raise ConfigError("<command line>", "training_script", "an existing script file", ns.training_script)
    if ns.submit:   # the same launch, run where the backend's scheduler places it
        from dualrun.backends import backend_of

        return backend_of(cfg).submit(cfg, _without_submit(ns.argv, ns.training_script), dry_run=ns.dry_run)
    result = run_job(cfg, program, plugin, dry_run=ns.dry_run)
    return result.exit_code


def _without_submit(argv: Sequence[str], script: str) -> list[str]:
    """`python -m dualrun ARGV` with `--submit` (and a dry run's `--dry_run`: it shows what a real submission
    runs) taken out of dualrun's own flags, those before the training script (the script's own arguments are left
    as they are): what the submitted job runs."""
    args = list(argv)
    end = args.index(script) if script in args else len(args)
    drop = ("--submit", "--dry_run", "--dry-run")
    return [sys.executable, "-m", "dualrun", *(a for a in args[:end] if a not in drop), *args[end:]]


def cmd_config_default(ns: argparse.Namespace) -> int:
    from dualrun.config.starter import detected_devices, starter_text

    path = ns.config_file or ns.path or "dualrun.yaml"
    if ns.config_file and ns.path and ns.path != ns.config_file:
        raise ConfigError("<command line>", "--config_file", f"the same path as the positional one ({ns.path})",
                          ns.config_file)
    if os.path.exists(path):
        raise ConfigError(path, "path", "a file that does not exist yet (dualrun never overwrites)",
                          "an existing directory" if os.path.isdir(path) else "an existing file")
    if not os.path.isdir(os.path.dirname(path) or "."):   # before detecting devices: that imports torch (seconds)
        raise ConfigError(path, "path", "a new file in an existing, writable folder", os.strerror(errno.ENOENT))
    devices, dist = (0, "NO") if ns.cpu else detected_devices()
    text = starter_text(path, ns.method, ns.cpu, devices, dist)
    try:
        with open(path, "x", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:   # a missing folder, no permission, a read-only disk
        raise ConfigError(path, "path", "a new file in an existing, writable folder", e.strerror or
                          type(e).__name__) from None
    found = "CPU config" if ns.cpu else (f"{devices} GPU(s) found" if devices else "no GPU found: a CPU config")
    print(f"wrote {path} ({found})")
    return 0


def cmd_config(ns: argparse.Namespace) -> int:
    """`dualrun config`: the questions (dualrun/config/questions.py) on this terminal, then the file, checked as
    `dualrun plan` checks it. Declining to overwrite writes nothing and exits 1 (the file asked for was not
    written); no terminal: exit 2, pointing at `dualrun config default`."""
    from dualrun.config.asking import converse, write_file
    from dualrun.config.questions import yaml_text, yes_no
    from dualrun.methods.question_context import question_context

    path = ns.ask_config_file or "dualrun.yaml"
    if not sys.stdin.isatty():
        raise ConfigError("<stdin>", "stdin", "a terminal to answer the questions on (without one: dualrun config "
                          "default [PATH] writes a starter config)", Said("not a terminal"))
    if os.path.isdir(path) or not os.path.isdir(os.path.dirname(path) or "."):
        raise ConfigError(path, "path", "a file in an existing folder", "an existing directory"
                          if os.path.isdir(path) else os.strerror(errno.ENOENT))
    try:
        if os.path.exists(path) and not _confirmed(f"{path} exists; overwrite? [y/N]: ", yes_no):
            print(f"nothing written: {path} is unchanged")
            return 1
        ctx = question_context()
        raw = converse(ctx, input, print, lambda raw: _plan_checked(path, yaml_text(raw, path)))
    except EOFError:
        print(f"\nno answer (end of input): nothing written to {path}")
        return 1
    write_file(path, yaml_text(raw, path))
    print(f"wrote {path}; see its layout with: dualrun plan --config_file {path}")
    return 0


def _confirmed(prompt: str, parse: Any) -> bool:
    while True:
        typed = input(prompt).strip() or "n"
        try:
            return bool(parse(typed))
        except ValueError:
            print("expected yes or no")


def _plan_checked(path: str, text: str) -> None:
    """What `dualrun plan --config_file PATH` checks, on the text about to be written there."""
    from dualrun.config.environment import check_environment
    from dualrun.config.load import build_config
    from dualrun.config.yamlfile import parse
    from dualrun.methods.plugin import get_plugin, validate

    cfg = build_config(parse(path, text), path)
    check_environment(backend=cfg.backend)
    plugin = get_plugin(cfg.method, cfg.source)
    validate(cfg, plugin)
    _plan_of(cfg, plugin)


def cmd_check(ns: argparse.Namespace) -> int:
    from dualrun.backends import backend_of
    from dualrun.check.preflight import run_check

    cfg, _ = _load(ns)
    if ns.wait_s is not None and not 0 < ns.wait_s <= 3600:
        raise ConfigError("<command line>", "--wait_s", "a number of seconds in (0, 3600]", str(ns.wait_s))
    if ns.wait_s is not None and not (cfg.backend_kind.per_machine and cfg.num_machines > 1):
        raise ConfigError("<command line>", "--wait_s", "no --wait_s here (only several torchrun machines wait for "
                          "each other's check)", str(ns.wait_s))
    backend = backend_of(cfg)
    return run_check(cfg, lambda c: backend.check(c, ns.wait_s))


def cmd_env(ns: argparse.Namespace) -> int:
    from dualrun.config.backends import backend_object, installed
    from dualrun.env.installed import report

    print(report([line for name in installed() if (line := backend_object(name).env_line()) is not None]))
    return 0


def cmd_scale(ns: argparse.Namespace) -> int:
    from dualrun.launchers.scale_request import scale

    return scale(ns.role, ns.replicas, ns.job)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    ns.argv = list(sys.argv[1:] if argv is None else argv)
    if ns.version:
        from dualrun import __version__

        print(f"dualrun {__version__}")
        return 0
    commands = {"launch": cmd_launch, "plan": cmd_plan, "check": cmd_check, "env": cmd_env, "scale": cmd_scale}
    try:
        if ns.command == "config":
            if ns.config_command is None:
                return cmd_config(ns)
            if ns.ask_config_file is not None:
                parser.error("usage: dualrun config default [PATH | --config_file PATH] [--method sft|pt|grpo|gkd] "
                             "[--cpu] (--config_file after `default`)")
            return cmd_config_default(ns)
        if ns.command not in commands:
            parser.print_help()
            return 2
        return commands[ns.command](ns)
    except DualrunError as e:
        sys.stderr.write(f"dualrun: error: {one_line(str(e), 1000)}\n")
        return e.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("dualrun: interrupted\n")
        return 130
    except BrokenPipeError:  # `dualrun plan | head`: the reader left; not an error of ours
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
    except Exception as e:  # noqa: BLE001 - the last resort: a bug of ours is still one line, never a traceback
        return _unexpected(e)


def _unexpected(e: Exception) -> int:
    """One line for an exception nothing else caught: exit 2 when nothing had started (it was raised while checking
    the input), 1 after. DUALRUN_DEBUG=1 prints the traceback too."""
    from dualrun.contract.redact import redact_text
    from dualrun.contract.errors import has_started

    if os.environ.get(protocol.DEBUG) == "1":
        import traceback

        traceback.print_exc()
    when = "while starting the job" if has_started() else "before anything started"
    detail = redact_text((str(e)[:2000].strip().splitlines() or [""])[0])
    sys.stderr.write(one_line(f"dualrun: error: unexpected {type(e).__name__} {when}: {detail} "
                              "(DUALRUN_DEBUG=1 shows the traceback)") + "\n")
    return 1 if has_started() else 2


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
