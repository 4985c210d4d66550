"""A one-machine job's rendezvous store on loopback only.

Why: torch's TCPStore server listens on every interface whatever host it is given, so a one-machine job's
rendezvous (torchrun's agent store; rank 0's store on Ray) would answer anyone on the network. Given a socket it
already listens on (`master_listen_fd`), it listens there: `loopback_stores()` makes every master store created at
a loopback host, in this process, listen on a socket bound to that host alone.
"""
from __future__ import annotations

import contextlib
import os
import socket
from typing import Any, Callable, Iterator, Mapping

LOOPBACK_HOSTS = ("127.0.0.1", "localhost")

# Where torch's rendezvous code names TCPStore (modules that imported it by name keep their own reference).
HOLDERS = ("torch.distributed", "torch.distributed.rendezvous",
            "torch.distributed.elastic.rendezvous.static_tcp_rendezvous",
            "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend")
_ARGS = ("host_name", "port", "world_size", "is_master", "timeout", "wait_for_workers", "multi_tenant",
         "master_listen_fd", "use_libuv")


def loopback_listener(host: str, port: int) -> int:
    """A socket listening on `host:port` alone (port 0: a free one); its file descriptor, owned by the caller."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1" if host == "localhost" else host, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock.detach()


def loopback_store_class(real: Any) -> Any:
    """A TCPStore whose master, at a loopback host, listens on that host alone."""

    class LoopbackTCPStore(real):   # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            given = store_args(args, kwargs)
            if given.get("is_master") and given.get("master_listen_fd") is None \
                    and given.get("host_name") in LOOPBACK_HOSTS:
                given["master_listen_fd"] = loopback_listener(given["host_name"], int(given.get("port") or 0))
            super().__init__(**given)

    LoopbackTCPStore.__qualname__ = LoopbackTCPStore.__name__ = "TCPStore"
    return LoopbackTCPStore


def store_args(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """A TCPStore constructor's arguments by name, however they were passed."""
    return dict(zip(_ARGS, args), **kwargs)


def swap_store_class(make: Callable[[Any], Any]) -> tuple[Any, list[Any]]:
    """torch's TCPStore, and the modules (HOLDERS) where `make(TCPStore)`, a subclass, now stands in its place."""
    import importlib

    import torch.distributed as dist

    real = dist.TCPStore
    patched = make(real)
    swapped = []
    for name in HOLDERS:
        module = importlib.import_module(name)
        if getattr(module, "TCPStore", None) is real:
            module.TCPStore = patched
            swapped.append(module)
    return real, swapped


@contextlib.contextmanager
def swapped_store_class(make: Callable[[Any], Any]) -> Iterator[None]:
    """While inside: `make(TCPStore)` in TCPStore's place (`swap_store_class`), torch's own again after."""
    real, swapped = swap_store_class(make)
    try:
        yield
    finally:
        for module in swapped:
            module.TCPStore = real


def loopback_stores() -> contextlib.AbstractContextManager[None]:
    """While inside: every TCPStore master this process creates at a loopback host listens on it alone."""
    return swapped_store_class(loopback_store_class)


def activate(environ: Mapping[str, str] | None = None) -> bool:
    """A rank of a one-machine job (MASTER_ADDR on loopback): for the rank's life, its stores at a loopback host
    (rank 0's rendezvous store on Ray, the weight-sync group's) listen there alone. True when it did."""
    environ = os.environ if environ is None else environ
    if environ.get("MASTER_ADDR") not in LOOPBACK_HOSTS:
        return False
    swap_store_class(loopback_store_class)
    return True
