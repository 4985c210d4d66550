"""The `slurm:` config section: what `--submit`'s batch script asks of SLURM beyond the plan's shape (time,
partition, account, qos, more sbatch options), each written as an `#SBATCH` line.

Why a section the backend declares (`Backend.section_keys`): the config checks it as its own sections (an unknown
key, a wrong type: one line naming the file and the key, exit 2) without the core knowing SLURM. sbatch's own
input variables (`SBATCH_TIMELIMIT`, `SBATCH_PARTITION`, ...) still win over these lines, as sbatch reads them.
Pure."""
from __future__ import annotations

import re
from typing import Any, Mapping

from dualrun.config.schema import Key
from dualrun.contract.errors import ConfigError

KEYS: tuple[Key, ...] = (
    Key("time", "str-or-null", None, "`--submit`: the job's time limit, `#SBATCH --time` (SLURM's forms: `'30'` "
        "minutes, `'1:00:00'`, `'2-00:00:00'`; quoted: YAML reads 1:00:00 as a number). Unset: the partition's "
        "default.", backends="slurm"),
    Key("partition", "str-or-null", None, "`--submit`: `#SBATCH --partition` (one name or a comma-separated list). "
        "Unset: the cluster's default.", backends="slurm"),
    Key("account", "str-or-null", None, "`--submit`: `#SBATCH --account`.", backends="slurm"),
    Key("qos", "str-or-null", None, "`--submit`: `#SBATCH --qos`.", backends="slurm"),
    Key("extra", "list", [], "`--submit`: more sbatch options, one `#SBATCH` line each, e.g. `[--exclusive, "
        "--mem=0]`; not the options dualrun writes itself (the plan's shape, the output file, the keys above).",
        backends="slurm"),
)

# What a SLURM time limit may look like: minutes, m:s, h:m:s, d-h, d-h:m, d-h:m:s; or no limit.
TIME = re.compile(r"^(\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}|INFINITE|UNLIMITED)$")
WORD = re.compile(r"^[A-Za-z0-9_.+-]+(,[A-Za-z0-9_.+-]+)*$")
# sbatch options the script already holds (the plan's shape, where its output goes) or a key of this section gives
OWN = {"--nodes": "-N", "--ntasks": "-n", "--ntasks-per-node": "", "--cpus-per-task": "-c", "--gpus-per-node": "",
       "--output": "-o", "--error": "-e", "--job-name": "-J", "--time": "-t", "--partition": "-p",
       "--account": "-A", "--qos": "-q"}


def check(source: str, values: Mapping[str, Any]) -> None:
    """What a key's type does not say: a time SLURM reads, one word (or a comma list) for the names, sbatch
    options that are options and none of those the script writes itself. One line and exit 2 otherwise."""
    time = values.get("time")
    if time is not None and not TIME.match(time.strip()):
        raise ConfigError(source, "slurm.time", "a SLURM time limit like '30' (minutes), '1:00:00' or '2-00:00:00'",
                          time)
    for key in ("partition", "account", "qos"):
        value = values.get(key)
        if value is not None and not WORD.match(value):
            raise ConfigError(source, f"slurm.{key}", "a SLURM name (letters, digits, _ . + -; a partition may be "
                              "a comma-separated list)", value)
    for i, option in enumerate(values.get("extra") or ()):
        where = f"slurm.extra[{i}]"
        if not isinstance(option, str) or not option.startswith("-") or "\n" in option or "\r" in option or \
                "\0" in option or not option.strip():
            raise ConfigError(source, where, "an sbatch option on one line, like --exclusive or --mem=0", option)
        flag = option.split("=", 1)[0].split()[0]
        long = next((name for name, short in OWN.items() if flag == name or (short and flag.startswith(short))), None)
        if long is not None:
            key = long.lstrip("-")
            instead = f"slurm.{key}" if key in ("time", "partition", "account", "qos") else \
                "the plan (dualrun writes it; SBATCH_* variables override it)"
            raise ConfigError(source, where, f"an option dualrun does not write itself ({long}: use {instead})",
                              option)


def sbatch_lines(options: Mapping[str, Any] | None) -> list[str]:
    """The section's `#SBATCH` lines, in the keys' order."""
    options = options or {}
    lines = [f"#SBATCH --{key}={options[key].strip()}" for key in ("time", "partition", "account", "qos")
             if options.get(key) is not None]
    return lines + [f"#SBATCH {option.strip()}" for option in options.get("extra") or ()]
