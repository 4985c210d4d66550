"""The plan's servers as `srun` steps, each on the allocation's node the plan gives it: the core's `LocalServers`
(start order, health checks, the supervisor's restarts, the events of a dying server, stop) with only the spawn
changed.

Why a subclass: a server stepped out with srun is, to this launcher, one local process (the `srun` client) whose
end is the server's end and whose SIGTERM srun forwards to the task; what differs is the command (`srun
--nodelist=NODE ...`), where it binds and the host it is reached at."""
from __future__ import annotations

from typing import Callable, Collection, Mapping

from dualrun.backends.slurm.steps import server_step, step_name
from dualrun.light.interpreter import resolve
from dualrun.plan.processes import Plan, Process
from dualrun.servers.local import Endpoint, LocalServers
from dualrun.servers.planned import replica_addresses
from dualrun.servers.process import ServerProcess
from dualrun.servers.supervisor import Supervisor


def endpoint(nodes: tuple[str, ...]) -> Endpoint:
    """One node: loopback (the launcher runs on it); several: every address, reached at the node's name."""
    return Endpoint("127.0.0.1", "127.0.0.1") if len(nodes) == 1 else Endpoint("0.0.0.0", "")


class SrunServers(LocalServers):
    """Every server of the plan (on whichever node), each its own srun step on node `nodes[proc.node]`."""

    def __init__(self, plan: Plan, nodes: tuple[str, ...], env_for: Callable[[Process], dict[str, str]],
                 wiring: Callable[[Mapping[str, str]], dict[str, str]], *, avoid: Collection[str] = (), tag: str = "") -> None:
        super().__init__(plan, env_for, wiring, avoid=avoid, endpoint=endpoint(nodes))
        self.nodes, self.tag = nodes, tag
        self.mine = list(range(len(plan.servers)))   # one launcher starts every node's servers
        self.supervisor = Supervisor(plan, self, self, lambda index: self.started.get(index), self.mine)

    def host_of(self, proc: Process) -> str:
        """The host the trainers and a router reach `proc` at."""
        return self.endpoint.advertised or self.nodes[proc.node]

    def _host_of(self, index: int) -> str:
        return self.host_of(self.plan.servers[index])

    def _spawn(self, index: int) -> ServerProcess:
        proc = self.plan.servers[index]
        serving = proc.serving
        assert serving is not None
        bind = self.endpoint.bind
        port = self._port(index)   # free here; on another node a taken one is retried (START_TRIES) unless handed out
        self._bound.add(f"{self.host_of(proc)}:{port}")
        argv = resolve(serving.argv(bind, port, replica_addresses(self.plan, self.started, index)))
        step = server_step(self.nodes[proc.node], argv, step_name(proc.label, self.tag))
        server = ServerProcess(proc.label, step, self.env_for(proc), bind, port, health_path=serving.health_path,
                               timeout_s=serving.health_timeout_s, log_path=self._log_path(proc), stream=self.stream,
                               check_host=self.host_of(proc))
        self._advertised[index] = f"{self.host_of(proc)}:{port}"
        return server.start()

