"""Servers a benchmark starts itself, one copy of each start: stub replicas, dualrun's CPU engines, and dualrun's router
or vllm-router in front of started ones."""
from __future__ import annotations

import os
import shutil
import sys

from benchlib import BENCH

VLLM_ROUTER_INSTALL = "pip install vllm-router==0.1.17"   # the version measured in results/router_vs_vllm.md


def _start(label: str, argv: list, port: int, stack: list, health_timeout_s: float):
    from dualrun.servers.process import ServerProcess

    s = ServerProcess(label, argv, dict(os.environ), "127.0.0.1", port, "/health", health_timeout_s,
                      stream=None).start()
    stack.append(s)
    return s


def start_stubs(n: int, stack: list, health_timeout_s: float = 30) -> list:
    """`n` replicas that answer at once (benchlib/stub.py), each a process on a free loopback port, healthy;
    appended to `stack`, which the caller stops."""
    from dualrun.light.ports import free_port

    out = []
    for i in range(n):
        port = free_port()
        out.append(_start(f"stub {i}", [sys.executable, str(BENCH / "benchlib" / "stub.py"), str(port)], port,
                          stack, health_timeout_s))
    for s in out:
        s.wait_healthy()
    return out


def start_router(replicas: list, stack: list, health_timeout_s: float = 120):
    """dualrun's router on a free loopback port in front of `replicas` (started `ServerProcess`es), healthy;
    appended to `stack`, which the caller stops."""
    from dualrun.light.ports import free_port
    from dualrun.plan.server_commands import router_argv

    port = free_port()
    r = _start("router", router_argv("127.0.0.1", port, [s.address for s in replicas]), port, stack,
               health_timeout_s)
    r.wait_healthy()
    return r


def vllm_router_bin() -> str | None:
    """The `vllm-router` command of this interpreter's environment (or on PATH), None when not installed."""
    here = os.path.join(os.path.dirname(sys.executable), "vllm-router")
    return here if os.access(here, os.X_OK) else shutil.which("vllm-router")


def start_vllm_router(replicas: list, stack: list, health_timeout_s: float = 120):
    """vllm-router (the vLLM project's Rust router) in front of `replicas`, round robin, probing each replica's
    `/health` every second as dualrun's router does, logging warnings only (dualrun's router logs no access
    line either); healthy, appended to `stack`."""
    from dualrun.light.ports import free_port

    binary = vllm_router_bin()
    if binary is None:
        raise RuntimeError(f"vllm-router is not installed: {VLLM_ROUTER_INSTALL}")
    port = free_port()
    argv = [binary, "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
            "--health-check-interval-secs", "1", "--log-level", "warning",
            "--worker-urls", *[f"http://{s.address}" for s in replicas]]
    r = _start("vllm-router", argv, port, stack, health_timeout_s)
    r.wait_healthy()
    return r


def start_cpu_engines(model: str, n: int, stack: list, health_timeout_s: float = 120) -> list:
    """`n` of dualrun's CPU engines (dualrun/programs/cpu_engine.py, one torch thread each, as dualrun
    starts them) serving `model`, healthy; appended to `stack`."""
    from dualrun.config.model import RoleSpec
    from dualrun.light.ports import free_port
    from dualrun.methods.commands import cpu_engine

    role = RoleSpec("rollout", 0, 1)
    out = []
    for i in range(n):
        port = free_port()
        out.append(_start(f"engine {i}", cpu_engine(role, model, "127.0.0.1", port), port, stack, health_timeout_s))
    for s in out:
        s.wait_healthy()
    return out
