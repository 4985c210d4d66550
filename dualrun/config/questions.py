"""`dualrun config`'s questions, as `accelerate config` asks them: pure, a function of the answers so far.

Why a walk over typed answers rather than a fixed list: which question comes next depends on the earlier answers
(a separate role asks for its GPUs and model, a colocated one does not), and so do defaults and bounds (the GPUs a
separate role may take are those the others left). The answers are kept as typed; every walk parses them again in
the context of the answers before them, so an answer that a changed earlier answer made invalid is asked again
instead of being kept. The terminal loop is `dualrun/config/asking.py`; nothing here reads or writes a terminal.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

from dualrun.config.schema import MAX_MACHINES, MAX_PER_MACHINE, MAX_TOP_K
from dualrun.contract.errors import shown

NONE, COLOCATED, SEPARATE = "none", "colocated", "separate"
PRECISIONS = ("no", "fp16", "bf16")    # accelerate's, less fp8 (it needs a backend of its own)
CPU_PROCESSES = 2                      # `dualrun config default`'s CPU starter
DEFAULT_PORT = 29500                   # what several torchrun machines use where main_process_port is unset
_HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.:_-]{0,252}$")


class Invalid(ValueError):
    """An answer a question does not take; `str()` is what it expects."""


@dataclass(frozen=True)
class MethodRoles:
    """What the questions read of a method plugin (`dualrun.methods.plugin.MethodPlugin`): its roles, the first
    the trainers', the roles whose colocated engine is TRL's (grpo's rollout), the roles that take the trainer's
    weights, and which role keys its worker half reads where (`role_key_reads`)."""

    name: str
    roles: tuple[str, ...]
    colocated_engine_roles: tuple[str, ...] = ()
    weight_roles: frozenset[str] = frozenset()
    reads: Mapping[str, Mapping[str, tuple[str, ...]]] = field(default_factory=dict)


@dataclass(frozen=True)
class Context:
    """What the questions offer: the installed backends (the first the default), the backends whose machines are
    each launched by hand (they ask for machine 0's address and take `<backend>.gpus_per_machine`), the methods,
    the engines (those whose one engine spans `tensor_parallel_size` devices, the defaults on GPUs and on CPUs),
    and this machine's accelerators (0: none) with accelerate's `distributed_type` for them."""

    backends: tuple[str, ...]
    by_hand: tuple[str, ...]
    methods: Mapping[str, MethodRoles]
    engines: tuple[str, ...]
    parallel_engines: tuple[str, ...]
    engine_on_gpus: str
    engine_on_cpus: str
    devices: int = 0
    dist: str = "MULTI_GPU"


@dataclass(frozen=True)
class Question:
    """One question: `key` stores its answer and is the config key it answers; `blamed` are the keys whose error,
    from dualrun's loader, asks it again. `default` None: an answer is needed."""

    key: str
    text: str
    parse: Callable[[str], Any]
    default: str | None = None
    blamed: tuple[str, ...] = ()

    def prompt(self) -> str:
        return f"{self.text} [{self.default}]: " if self.default is not None else f"{self.text}: "

    def value(self, typed: str) -> Any:
        """The answer's value; Enter takes the default. Raises Invalid naming what is expected."""
        typed = typed.strip()
        if not typed:
            if self.default is None:
                raise Invalid("an answer (this question has no default)")
            typed = self.default
        return self.parse(typed)

    def complaint(self, typed: str, why: Invalid) -> str:
        """The one line an invalid answer gets before the question is asked again."""
        return f"{self.key}: expected {why}, got {shown(typed.strip()) if typed.strip() else 'nothing'}"


def integer(low: int, high: int, divides: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        expected = f"an integer from {low} to {high}" + (f" that divides {divides}" if divides else "")
        if not re.fullmatch(r"\d{1,9}", text):
            raise Invalid(expected)
        value = int(text)
        if not low <= value <= high or (divides and divides % value):
            raise Invalid(expected)
        return value
    return parse


def choice(options: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text.lower() not in options:
            raise Invalid("one of " + ", ".join(options))
        return text.lower()
    return parse


def yes_no(text: str) -> bool:
    answer = text.lower()
    if answer not in ("y", "yes", "n", "no"):
        raise Invalid("yes or no")
    return answer.startswith("y")


def host(text: str) -> str:
    if not _HOST.fullmatch(text):
        raise Invalid("an IP address or host name")
    return text


def model(text: str) -> str:
    if any(c.isspace() for c in text) or len(text) > 4096:
        raise Invalid("a model path or hub name (no spaces)")
    return text


def optional(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`-` stands for no value: the key is left out of the file."""
    return lambda text: None if text == "-" else parse(text)


def _options(text: str, options: tuple[str, ...]) -> str:
    return f"{text} ({', '.join(options)})"


class _Stop(Exception):
    """The walk reached a question without a valid answer."""


_UNANSWERED = object()
Ask = Callable[[Question], Iterator[tuple[Question, Any]]]


def questions(ctx: Context, answers: Mapping[str, str]) -> Iterator[tuple[Question, Any]]:
    """Each question the answers so far reach, with its answer's value; the walk stops at the first question not
    (validly) answered, which it yields with the value `_UNANSWERED`."""
    def ask(q: Question) -> Iterator[tuple[Question, Any]]:
        try:
            value = q.value(answers[q.key])
        except (KeyError, Invalid):
            value = _UNANSWERED
        yield q, value
        if value is _UNANSWERED:
            raise _Stop
        return value

    try:
        yield from _walk(ctx, ask)
    except _Stop:
        return


def _walk(ctx: Context, ask: Ask) -> Iterator[tuple[Question, Any]]:
    backend = yield from ask(Question("backend", _options("Which backend runs the job?", ctx.backends),
                                      choice(ctx.backends), ctx.backends[0]))
    machines = yield from ask(Question("num_machines", "How many different machines will you use (use more than 1 "
                                       "for multi-node training)?", integer(1, MAX_MACHINES), "1"))
    if machines > 1 and backend in ctx.by_hand:
        yield from ask(Question("main_process_ip", "What is the IP address of the machine that will host the main "
                                "process (machine 0)?", host))
        yield from ask(Question("main_process_port", "What is the port you will use to communicate with the main "
                                "process?", integer(1, 65535), str(DEFAULT_PORT)))
    cpu = yield from ask(Question("use_cpu", "Do you want to run your training on CPU only (no GPUs)? (yes, no)",
                                  yes_no, "no" if ctx.devices else "yes"))
    unit = "processes" if cpu else "GPUs"
    per_machine = yield from ask(Question("machine_gpus", f"How many {unit} does each machine give the job?",
                                          integer(1, MAX_PER_MACHINE), str(CPU_PROCESSES if cpu else
                                                                           max(ctx.devices, 1)),
                                          ("gpus_per_machine",)))
    if not cpu:
        yield from ask(Question("mixed_precision", _options("Do you wish to use mixed precision?", PRECISIONS),
                                choice(PRECISIONS), "bf16"))
    names = tuple(ctx.methods)
    name = yield from ask(Question("method", _options("Which method does the script train with?", names),
                                   choice(names), names[0]))
    method = ctx.methods[name]
    free = machines * per_machine
    for role in method.roles[1:]:
        free -= yield from _role(ctx, method, role, cpu, free, ask)
    primary = method.roles[0]
    yield from ask(Question(f"roles.{primary}.gpus", f"How many {unit} do the trainers take (roles.{primary}.gpus)?",
                            integer(1, free), str(free), ("num_processes",)))


def _role(ctx: Context, method: MethodRoles, role: str, cpu: bool, free: int, ask: Ask
          ) -> Iterator[tuple[Question, Any]]:
    """The questions of one role beside the trainers; returns the GPUs it takes from the others."""
    key = f"roles.{role}"
    unit, where = ("processes", "CPU processes") if cpu else ("GPUs", "GPUs")
    layouts = (NONE, COLOCATED, SEPARATE) if free > 1 else (NONE, COLOCATED)
    kinds = "none; colocated: inside the trainer processes" + (f"; separate: a server on {where} of its own"
                                                               if SEPARATE in layouts else "")
    layout = yield from ask(Question(key, f"Does the job have a `{role}` role ({kinds})?", choice(layouts), NONE,
                                     ("colocate_groups",)))
    if layout == NONE:
        return 0
    separate, reads = layout == SEPARATE, method.reads.get(role, {})
    gpus = 0
    if separate:
        gpus = yield from ask(Question(f"{key}.gpus", f"How many {unit} does the `{role}` server take?",
                                       integer(1, free - 1), "1"))
    if separate or role in method.colocated_engine_roles:
        default = ctx.engine_on_cpus if cpu and role not in method.weight_roles else ctx.engine_on_gpus
        engine = yield from ask(Question(f"{key}.engine", _options(f"Which engine runs the `{role}` role?",
                                                                   ctx.engines), choice(ctx.engines), default))
        if separate and not cpu and gpus > 1 and engine in ctx.parallel_engines:
            yield from ask(Question(f"{key}.tensor_parallel_size", f"How many of its {gpus} GPUs does one engine "
                                    "span (tensor_parallel_size; the rest are more replicas)?",
                                    integer(1, gpus, divides=gpus), "1"))
    if separate or layout in reads.get("model", ()):
        weights = " (the model being trained: it takes the trainer's weights)" if role in method.weight_roles else ""
        yield from ask(Question(f"{key}.model", f"Which model does the `{role}` role serve{weights}? A path or hub "
                                "name" + ("" if separate else "; - for none (the script names it)"),
                                model if separate else optional(model), None if separate else "-"))
    if layout in reads.get("top_k", ()):
        low, default = (1, "20") if separate else (0, "0")
        yield from ask(Question(f"{key}.top_k", f"How many top log-probabilities per token does the `{role}` give "
                                "(top_k" + ("" if low else "; 0: the full vocabulary") + ")?",
                                integer(low, MAX_TOP_K), default))
    return gpus


def next_question(ctx: Context, answers: Mapping[str, str]) -> Question | None:
    """The first question not yet (validly) answered; None when every question the answers reach is."""
    for q, value in questions(ctx, answers):
        if value is _UNANSWERED:
            return q
    return None


def blamed_question(ctx: Context, answers: Mapping[str, str], key: str) -> Question | None:
    """The question to ask again for a loader's error about config key `key`: the one answering it (or naming it
    as blamed), else the nearest one answering a key above it (`roles.rollout` for `roles.rollout.server_args`)."""
    asked = [q for q, _ in questions(ctx, answers)]
    exact = [q for q in asked if key == q.key or key in q.blamed or any(key.endswith("." + b) for b in q.blamed)]
    if exact:
        return exact[0]
    above = [q for q in asked if key.startswith(q.key + ".")]
    return max(above, key=lambda q: len(q.key)) if above else None


def config_of(ctx: Context, answers: Mapping[str, str]) -> dict[str, Any]:
    """The config file's content (accelerate's keys, then dualrun's) for a complete set of answers."""
    values = {q.key: value for q, value in questions(ctx, answers)}
    if any(value is _UNANSWERED for value in values.values()):
        raise ValueError("config_of needs every question answered (next_question is not None)")
    cpu, method = values["use_cpu"], ctx.methods[values["method"]]
    raw: dict[str, Any] = {"compute_environment": "LOCAL_MACHINE",
                           "distributed_type": "MULTI_CPU" if cpu else (ctx.dist if ctx.devices else "MULTI_GPU"),
                           "mixed_precision": "no" if cpu else values["mixed_precision"], "use_cpu": cpu,
                           "num_machines": values["num_machines"]}
    for key in ("main_process_ip", "main_process_port"):
        if key in values:
            raw[key] = values[key]
    raw["backend"], raw["method"] = values["backend"], values["method"]
    primary = method.roles[0]
    trainers = values[f"roles.{primary}.gpus"]
    roles: dict[str, dict[str, Any]] = {primary: {"gpus": trainers}}
    colocated = [primary]
    for role in method.roles[1:]:
        layout = values[f"roles.{role}"]
        if layout == NONE:
            continue
        spec = {"gpus": values[f"roles.{role}.gpus"] if layout == SEPARATE else trainers}
        for name in ("engine", "tensor_parallel_size", "model", "top_k"):
            value = values.get(f"roles.{role}.{name}")
            if value is not None and not (name == "top_k" and value == 0):
                spec[name] = value
        roles[role] = spec
        if layout == COLOCATED:
            colocated.append(role)
    raw["roles"] = roles
    if len(colocated) > 1:
        raw["colocate_groups"] = [colocated]
    if values["backend"] in ctx.by_hand and values["num_machines"] > 1:
        raw[values["backend"]] = {"gpus_per_machine": values["machine_gpus"]}
    return raw


HEADER = """\
# Written by `dualrun config` from your answers. accelerate's keys keep accelerate's meaning; dualrun adds backend,
# method, roles, ... (docs/config-reference.md). See the layout:  dualrun plan --config_file {path}
# Run it with:  dualrun launch --config_file {path} train.py --your --args
"""


def yaml_text(raw: Mapping[str, Any], path: str) -> str:
    """The file as written: a header, then the keys in `raw`'s order, each role's settings on one line."""
    import yaml

    body = yaml.safe_dump(dict(raw), sort_keys=False, default_flow_style=None, width=120)
    tail = ""
    if raw.get("num_machines", 1) > 1 and "main_process_ip" in raw:
        tail = "# On machine K (1, 2, ...) launch with --machine_rank K as well.\n"
    return HEADER.format(path=path) + body + tail
