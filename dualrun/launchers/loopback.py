"""Refuse, before anything starts, an interface variable naming loopback on a job across machines.

Why: a user's GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME / TP_SOCKET_IFNAME wins over dualrun's choice, and `lo` left
exported from a one-machine recipe looks fine on each machine: gloo then binds and advertises 127.0.0.1, the other
machines dial themselves, and the job fails in its first collective naming another cause, or hangs (issue 49).
A one-machine job keeps accepting it. The pure test is `dualrun.light.interfaces.loopback_named`.
"""
from __future__ import annotations

import os
from typing import Iterable, Mapping

from dualrun.contract.errors import LaunchError
from dualrun.light.interfaces import Interface, loopback_line, loopback_named


def refuse_loopback(envs: Iterable[Mapping[str, str]], machines: str, ifaces: Mapping[str, Interface],
                    instead: str | None = None) -> None:
    """Raise LaunchError (exit 2, one line) for the first process env of `envs` that names a loopback interface;
    the line says where the value came from (the launching shell or the config)."""
    for env in envs:
        for var, value, name in loopback_named(env, ifaces):
            where = "the launching shell" if os.environ.get(var, "").strip() == value else "the config's env"
            raise LaunchError(f"{loopback_line(var, value, name, ifaces, machines, instead)} (set in {where})", 2)
