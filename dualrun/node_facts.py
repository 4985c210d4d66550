"""What one machine looks like to a job: versions, the launching directory, addresses it can reach.

Runs on the driver and, for `dualrun check` on Ray, as a task on every node: keep it free of torch and Ray
(versions are read from package metadata, which is what `pip` reports, without importing the packages).
"""
from __future__ import annotations

import os
import platform
import socket
from typing import Any, Iterable

from dualrun.envinfo import version

CHECKED_PACKAGES = ("torch", "transformers", "trl", "accelerate", "dualrun")


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
    """None when this machine can listen on host:port (a free port on one of its addresses), else why not."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, int(port)))
        except socket.gaierror:
            return f"{host} does not resolve"
        except OSError as e:
            return e.strerror or type(e).__name__
    return None


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
    }
