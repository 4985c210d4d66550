"""The actor that runs one of a job's servers on its Ray node (backends/ray/actor_servers.py places and drives it).

Why a module of its own: Ray worker processes import it, so it needs only the standard library (and ray), while
the driver's side (`RayServers`) imports the plan and the replicas' supervisor.
"""
from __future__ import annotations

import os
import tempfile

from dualrun.light.line_queue import STDERR, LineQueue
from dualrun.contract.protocol import ActorPlace, ServerStart
from dualrun.servers.process import ServerError, ServerProcess


class ServerActor:
    """One server on the actor's node. Threaded actor: `stop` may run while `start` still waits for health."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.server: ServerProcess | None = None
        self.output = LineQueue()   # the server's lines, `[label] ...`, for the driver's long-poll (`lines`)

    def where(self, avoid: list[int] | None = None, handed_out: bool = False) -> ActorPlace:
        """This actor's node, GPUs and a free port there (`handed_out`: one the trainers get before the server
        binds it, `server_port`)."""
        import ray

        from dualrun.light.interfaces import holding
        from dualrun.light.ports import free_port, server_port

        ip = ray.util.get_node_ip_address()
        port = (server_port if handed_out else free_port)(ip, set(avoid or ()))
        return ActorPlace(ip, ray.get_runtime_context().get_node_id(), tuple(str(g) for g in ray.get_gpu_ids()),
                          os.getpid(), port, interface=holding(ip))

    def start(self, argv: list[str], env: dict[str, str], host: str, port: int, health_path: str,
              timeout_s: float, log_path: str | None, cwd: str | None = None) -> ServerStart:
        """Start and wait for health; the outcome as a value (never an exception: it must cross Ray intact).

        `cwd`: the launching directory, as for the ranks, so a relative `model:` means what it means under
        torchrun (a Ray worker's own directory is Ray's session dir on a running cluster); on a node without that
        directory the server runs where Ray put it and only absolute paths work."""
        if log_path is None:
            log_path = os.path.join(tempfile.mkdtemp(prefix="dualrun-server-"), "server.log")
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        self.server = ServerProcess(self.label, argv, env, host, port, health_path, timeout_s, log_path,
                                    stream=_Lines(self.output), cwd=cwd if cwd and os.path.isdir(cwd) else None)
        try:
            self.server.start().wait_healthy()
        except ServerError as e:
            self.server.stop()   # its output stays open: a lost port is retried by this actor (`stop` closes it)
            return ServerStart(False, error=str(e), port_in_use=e.lost_port)
        return ServerStart(True, self.server.address, self.server.proc.pid if self.server.proc else None)

    def alive(self) -> bool:
        return self.server is not None and self.server.alive()

    def wait_exit(self) -> str:
        """Block until the server ends; the error naming it, its exit code and its log's last lines."""
        assert self.server is not None, "start() was not called"
        try:
            return str(self.server.wait_exit())   # its output read to the end
        finally:
            self.output.close()

    def tail(self) -> tuple[str, str | None]:
        """The server's last log lines and its log's path (for the event of a hung one that was stopped)."""
        return (self.server.tail(), self.server.log_path) if self.server is not None else ("", None)

    def lines(self, timeout: float = 5.0) -> list[tuple[int, str]] | None:
        """Long-poll: the server's queued output lines; None once it has ended."""
        return self.output.take(timeout)

    def stop(self, grace_s: float = 10.0) -> int | None:
        code = self.server.stop(grace_s) if self.server is not None else None
        self.output.close()
        return code


class _Lines:
    """The text stream ServerProcess tees the server's output to (one prefixed line per write): the queue."""

    def __init__(self, output: LineQueue) -> None:
        self.output = output

    def write(self, text: str) -> None:
        self.output.put(STDERR, text.rstrip("\n"))

    def flush(self) -> None:
        pass
