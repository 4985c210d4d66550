"""Picking a free TCP port: the one copy every launcher, server and Ray actor uses (standard library only,
so Ray worker processes import it without torch or the rest of dualrun)."""
from __future__ import annotations

import socket
from typing import Collection

_TRIES = 50


def free_port(host: str = "127.0.0.1", avoid: Collection[int] = ()) -> int:
    """A port free right now on `host`, picked by the OS (no fixed ports, so jobs never collide), and not one
    of `avoid` (the ports of servers that died: a restart never reuses a dead server's address)."""
    for _ in range(_TRIES):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in avoid:
            return port
    raise OSError(f"no free port on {host} outside {len(avoid)} excluded ones after {_TRIES} tries")


def server_port(host: str = "127.0.0.1", avoid: Collection[int] = ()) -> int:
    """A port free right now on `host` for a server whose address is handed out before it binds (the trainers start
    beside it): below the range the OS gives outgoing connections (`ip_local_port_range`), so no connection of
    another process takes it between the pick and the bind, and above Ray's worker ports (10002-19999). Another
    program picking ports there could still; the bind then fails, named."""
    import random

    low, _ = _ephemeral_range()
    first = 20000 if low > 21000 else 1024
    for _ in range(_TRIES if low - first > 1000 else 0):
        port = random.randrange(first, low)
        if port in avoid:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        return port
    return free_port(host, avoid)


def _ephemeral_range() -> tuple[int, int]:
    """The OS's range for outgoing connections' ports (Linux's default when it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports free right now on `host` (all held open while picking, so none is picked twice)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def route_address(peer: str) -> str:
    """This machine's address on its route to `peer`: the interface the OS would send from, so the address `peer`
    reaches it at on a flat network (127.0.0.1 when `peer` is loopback). No packet is sent (a UDP connect only
    picks the route); a peer that does not resolve gives this host name's address."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer, 9))
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


EVERY_ADDRESS = ""   # bind's "every address of this machine", as torch's store listens when not on loopback alone


def port_taken(port: int, host: str = EVERY_ADDRESS) -> str | None:
    """Why `port` cannot be listened on at `host` right now (`Address already in use`), or None when it is free.
    Bound as a rendezvous store binds it (SO_REUSEADDR, then listen): a port another process listens on is taken;
    one only lingering in TIME_WAIT after a previous job is not, since the store would take it too. The launch checks
    before anything starts, so a port held by another program is one line, not an OSError from deep in torch."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, int(port)))
            s.listen(1)
        except socket.gaierror:
            return f"{host} does not resolve"
        except OSError as e:
            return e.strerror or type(e).__name__
    return None
