"""Server lifecycle for separate roles (rollout / teacher servers), shared by both backends.

`ServerProcess` runs one server command on this node: start, wait for health (with a timeout and the log's tail in the
error), stop (the whole process group). A job's servers are a server set (`serverset.py`: start, addresses, wiring,
death events, stop), built from the plan alone (each server's `Serving`, plan/servers.py) and what only the run knows:
`LocalServers` (local.py) for the servers a torchrun plan puts on this machine, with `Machines`
(backends/torchrun/machine_servers.py) around it on several machines; `RayServers` (backends/ray/actor_servers.py) from
an actor per server (backends/ray/actors/server_actor.py) in its own placement group. Each set gives a few primitives
(respawn, alive, kill) to its one `Supervisor` (supervisor.py), which restarts dead or hung replicas under the pure
rules of supervision.py.
`planned.py`: the method's commands put into the plan, start order, addresses, the trainers' wiring.
"""
from dualrun.servers.process import ServerError, ServerProcess

__all__ = ["ServerError", "ServerProcess"]
