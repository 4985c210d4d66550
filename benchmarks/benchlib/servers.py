"""dualrun's CPU engines and its replica router, started by a benchmark itself (in front of stubs, CPU engines,
vLLM): one copy of each start for every benchmark."""
from __future__ import annotations

import os


def start_router(replicas: list, stack: list, health_timeout_s: float = 120):
    """dualrun's router on a free loopback port in front of `replicas` (started `ServerProcess`es), healthy;
    appended to `stack`, which the caller stops."""
    from dualrun.ports import free_port
    from dualrun.servers.process import ServerProcess
    from dualrun.servers.router import router_argv

    port = free_port()
    r = ServerProcess("router", router_argv("127.0.0.1", port, [s.address for s in replicas]), dict(os.environ),
                      "127.0.0.1", port, "/health", health_timeout_s, stream=None).start()
    stack.append(r)
    r.wait_healthy()
    return r


def start_engines(model: str, n: int, stack: list) -> list:
    """`n` of dualrun's CPU engines serving `model` (one torch thread each, as dualrun starts them) on free loopback
    ports, all started at once, then each waited for until healthy; appended to `stack`, which the caller stops."""
    from dualrun.config.model import RoleSpec
    from dualrun.ports import free_port
    from dualrun.servers.commands import cpu_engine
    from dualrun.servers.process import ServerProcess

    role = RoleSpec("rollout", 0, 1)
    out = []
    for i in range(n):
        port = free_port()
        out.append(ServerProcess(f"engine {i}", cpu_engine(role, model, "127.0.0.1", port), dict(os.environ),
                                 "127.0.0.1", port, "/health", 120, stream=None).start())
    stack.extend(out)
    for s in out:
        s.wait_healthy()
    return out
