"""Server lifecycle for separate roles (rollout / teacher servers), shared by both backends.

`ServerProcess` runs one server command on this node: start, wait for health (with a timeout and the
log's tail in the error), stop (the whole process group). `LocalServers` starts the servers a torchrun plan
puts on this node; `dualrun.servers.ray_server` does the same from an actor in the role's placement group.
"""
from dualrun.servers.process import ServerError, ServerProcess

__all__ = ["ServerError", "ServerProcess"]
