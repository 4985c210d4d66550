"""Server lifecycle for separate roles (rollout / teacher servers), shared by both backends.

`ServerProcess` runs one server command on this node: start, wait for health (with a timeout and the
log's tail in the error), stop (the whole process group). A job's servers are a server set (`serverset.py`:
start, addresses, death events, stop): `LocalServers` (local.py) for the servers a torchrun plan puts on this
machine, with `machines.py` coordinating several machines; `RayServers` (ray_server.py) from an actor per server
(ray_actor.py) in its own placement group. `planned.py`: what the plan's servers are, on either backend;
`replacing.py`: which dead or hung replicas are restarted (the restart itself: `ServerSet._replace`).
"""
from dualrun.servers.process import ServerError, ServerProcess

__all__ = ["ServerError", "ServerProcess"]
