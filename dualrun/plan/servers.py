"""What the plan says of each server it places: its command, health check, timeouts, restart budget and log.

Why in the plan: a server set (either backend) starts, checks, restarts and logs the plan's servers from this
record and from what only the run knows (the port picked free, the node's address, the replicas' addresses for a
router), never from the config. `make_plan` fills in what the config decides; the command and the health path are
the method's (its plugin builds the command for a host and port) and are filled in by `make_plan(cfg, cluster, method)`
(plan/server_commands.py; `dualrun check` places without them). Pure.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence


HOST = "<host>"   # where a server's command takes the address it binds
PORT = "<port>"   # ... and the port picked free for it
ROUTER = "router"   # the kind of the process that puts a separate role's engine replicas behind one address


def replicas_of(plan: "Any", unit: str) -> list[int]:
    """plan.servers indices of `unit`'s engine replicas (its router's slots, in order)."""
    return [i for i, p in enumerate(plan.servers) if p.unit == unit and p.kind != ROUTER]


def replica_slot(index: int) -> str:
    """Where a router's command takes the address of its `index`-th replica."""
    return f"<replica {index}>"


@dataclass(frozen=True)
class Serving:
    """One server of the plan, as every backend starts, checks and restarts it.

    `command`: its argv with `HOST`, `PORT` and (a router's) `replica_slot(i)` where the run puts its values;
    empty until `make_plan` is given the method (`server_commands.with_commands`). `restarts`: how often a dead or hung replica is started again (0: its death ends
    the job; a router, and an engine without one, have none). `takes_weights`: a restarted replica waits out of
    rotation until the trainer's weights reach it. `log_dir`: where its log goes (None: the backend picks)."""

    health_timeout_s: float
    request_timeout_s: float
    restarts: int = 0
    takes_weights: bool = False
    log_name: str = ""
    log_dir: str | None = None
    command: tuple[str, ...] = ()
    health_path: str = "/health"
    spare: bool = False   # a replica above the planned count: placed, not started at launch (`dualrun scale`)

    @property
    def log_path(self) -> str | None:
        return os.path.join(self.log_dir, self.log_name) if self.log_dir else None

    def argv(self, host: str, port: "int | str", replicas: Sequence[str] = ()) -> list[str]:
        """The command for `host:port` (a router's: in front of `replicas`, in replica order)."""
        if not self.command:
            raise ValueError("the plan was made without the method's server commands (with_commands)")
        slots = {replica_slot(i): address for i, address in enumerate(replicas)}
        if len(slots) != sum(a.startswith("<replica ") for a in self.command):
            raise ValueError(f"{len(slots)} replica address(es) for a command with "
                             f"{sum(a.startswith('<replica ') for a in self.command)} replica slot(s)")
        return [slots.get(a) or a.replace(HOST, host).replace(PORT, str(port)) for a in self.command]
