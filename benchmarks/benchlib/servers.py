"""dualrun's replica router started in front of servers a benchmark started itself (stubs, CPU engines, vLLM)."""
from __future__ import annotations

import os


def start_router(replicas: list, stack: list, health_timeout_s: float = 120):
    """dualrun's router on a free loopback port in front of `replicas` (started `ServerProcess`es), healthy;
    appended to `stack`, which the caller stops."""
    from dualrun.light.ports import free_port
    from dualrun.servers.process import ServerProcess
    from dualrun.serving.router import router_argv

    port = free_port()
    r = ServerProcess("router", router_argv("127.0.0.1", port, [s.address for s in replicas]), dict(os.environ),
                      "127.0.0.1", port, "/health", health_timeout_s, stream=None).start()
    stack.append(r)
    r.wait_healthy()
    return r
