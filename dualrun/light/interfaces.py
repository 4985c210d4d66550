"""This machine's network interfaces, and the addresses a job's processes pick on them.

Why: across machines a job works only when each machine's processes advertise an address the others reach. Which
one they pick is decided by variables and names that look fine on one machine: `GLOO_SOCKET_IFNAME` (an interface
every machine must have), the host name (gloo binds the address it resolves to, loopback where it resolves to
nothing here; Debian's `127.0.1.1 host` line is such a trap), the route to machine 0 (dualrun advertises a
machine's servers at its address on that route). `dualrun check` reads them here and compares across machines.

Standard library only (Linux ioctls; elsewhere the interface table is empty and nothing is claimed).
"""
from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Mapping

_SIOCGIFADDR = 0x8915
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")


@dataclass(frozen=True)
class Interface:
    name: str
    address: str | None   # its IPv4 address (None: it has none)
    state: str            # the kernel's operstate: up, down, lowerlayerdown (no carrier), unknown (lo)

    def __str__(self) -> str:
        state = "" if self.state in ("up", "unknown") else f" ({_STATES.get(self.state, self.state)})"
        return f"{self.name} {self.address or 'without an IPv4 address'}{state}"


_STATES = {"down": "down", "lowerlayerdown": "no carrier", "dormant": "dormant", "notpresent": "not present"}


def _ipv4(name: str) -> str | None:
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def _state(name: str) -> str:
    try:
        with open(f"/sys/class/net/{name}/operstate") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def interfaces() -> dict[str, Interface]:
    """Every interface of this machine's network namespace, by name."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):
        return {}
    return {n: Interface(n, _ipv4(n), _state(n)) for n in names}


def listing(ifaces: Mapping[str, Interface]) -> str:
    """'eth0 10.0.0.2, lo 127.0.0.1': the interfaces with an address first, for one line."""
    ordered = sorted(ifaces.values(), key=lambda i: (i.address is None, i.name == "lo", i.name))
    return ", ".join(str(i) for i in ordered) or "none"


def owner(address: str, ifaces: Mapping[str, Interface]) -> Interface | None:
    """The interface holding `address` (a loopback address belongs to lo)."""
    for i in ifaces.values():
        if i.address == address:
            return i
    if address.startswith("127."):
        return ifaces.get("lo")
    return None


def route(peer: str) -> tuple[str | None, str | None]:
    """(this machine's address on its route to `peer`, why not): the kernel picks the route for a UDP connect,
    nothing is sent."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer, 9))
            return s.getsockname()[0], None
    except socket.gaierror:
        return None, f"{peer} does not resolve"
    except OSError as e:
        return None, e.strerror or type(e).__name__


def reached_at(main: str) -> str | None:
    """This machine's address the other machines of a job reach it at: its address on the route to machine 0's
    `main`; on machine 0, where `main` may be its own host name resolving to loopback there (Debian's `127.0.1.1 host`
    line) while the others resolve it to its network address, its address on the route out (no packet is sent)."""
    address, _ = route(main)
    if address and address.startswith("127.") and not (main.startswith("127.") or main == "localhost"):
        out, _ = route("8.8.8.8")
        return out or address
    return address


def _names(value: str) -> list[str]:
    return [n.strip() for n in value.split(",") if n.strip()]


def ifname_problems(env: Mapping[str, str], ifaces: Mapping[str, Interface]) -> list[str]:
    """Pure: one phrase for each interface variable of `env` that this machine cannot honour: gloo and TensorPipe
    need every named interface, with an address; NCCL one interface matching its prefixes (`=` exact; a `^` list
    excludes, which nothing here can break)."""
    out = []
    for var in IFNAME_VARS:
        value = env.get(var, "").strip()
        if not value or (var == "NCCL_SOCKET_IFNAME" and value.startswith("^")):
            continue
        if var == "NCCL_SOCKET_IFNAME":
            exact, wanted = value.startswith("="), _names(value.lstrip("="))
            hits = [i for i in ifaces.values() if any(i.name == w if exact else i.name.startswith(w) for w in wanted)]
            if not any(i.address for i in hits):
                out.append(f"{var}={value} matches no interface of this machine with an address")
            continue
        for name in _names(value)[:1] if var == "TP_SOCKET_IFNAME" else _names(value):
            if name not in ifaces:
                out.append(f"{var}={value} names {name}, which this machine does not have")
            elif not ifaces[name].address:
                out.append(f"{var}={value} names {name}, which has no IPv4 address here")
    return out


def _loopback(name: str, ifaces: Mapping[str, Interface]) -> bool:
    """Whether interface `name` is this machine's loopback: `lo`, or one holding only a 127.x address."""
    found = ifaces.get(name)
    return name == "lo" or bool(found is not None and found.address and found.address.startswith("127."))


def loopback_named(env: Mapping[str, str], ifaces: Mapping[str, Interface]) -> list[tuple[str, str, str]]:
    """Pure: (variable, its value, the loopback interface it names) for each interface variable of `env` that puts
    a transport on loopback, where no other machine can reach it: gloo makes a device of every name, TensorPipe uses
    the first, NCCL any interface matching its prefixes (a `^` list excludes: it cannot name loopback)."""
    out = []
    for var in IFNAME_VARS:
        value = env.get(var, "").strip()
        if not value or (var == "NCCL_SOCKET_IFNAME" and value.startswith("^")):
            continue
        names = _names(value.lstrip("=") if var == "NCCL_SOCKET_IFNAME" else value)
        if var == "TP_SOCKET_IFNAME":
            names = names[:1]
        for name in names:
            if var == "NCCL_SOCKET_IFNAME" and not value.startswith("="):   # a prefix: what it matches here
                hits = [n for n in (*ifaces, "lo") if n.startswith(name) and _loopback(n, ifaces)]
            else:
                hits = [name] if _loopback(name, ifaces) else []
            if hits:
                out.append((var, value, hits[0]))
                break
    return out


def loopback_line(var: str, value: str, name: str, ifaces: Mapping[str, Interface], machines: str,
                  instead: str | None = None) -> str:
    """Why `var=value` cannot work on a job across machines (`machines`: 'num_machines 2', '2 Ray nodes'), and what
    to do; `instead`: the interface dualrun would give gloo here (the one the other machines reach this one at)."""
    found = ifaces.get(name)
    held = f" ({found.address})" if found is not None and found.address else ""
    fix = f"unset it (dualrun then gives gloo {instead}, the interface the other machines reach this one at) or " \
          f"name that interface" if instead else "unset it or name the interface the other machines reach this one at"
    return (f"{var}={value} names {name}{held}, a loopback interface: on a job across machines ({machines}) the other "
            f"machines cannot reach it, and the job would hang or fail in its first collective; {fix}")


def gloo_address(env: Mapping[str, str], ifaces: Mapping[str, Interface],
                 hostname: str | None = None) -> tuple[str | None, str]:
    """(the address gloo binds and advertises to the other ranks, why that one), as torch's gloo picks it: the first
    interface of GLOO_SOCKET_IFNAME; else the first address the host name resolves to that can be bound here; else
    loopback (torch warns). None when GLOO_SOCKET_IFNAME names an interface this machine lacks."""
    names = _names(env.get("GLOO_SOCKET_IFNAME", ""))
    if names:
        found = ifaces.get(names[0])
        return (found.address if found else None), f"GLOO_SOCKET_IFNAME={names[0]}"
    hostname = hostname or socket.gethostname()
    try:
        resolved = [a[4][0] for a in socket.getaddrinfo(hostname, None, socket.AF_INET, socket.SOCK_STREAM)]
    except OSError:
        resolved = []
    for address in dict.fromkeys(resolved):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((address, 0))
            except OSError:
                continue
        return address, f"the host name {hostname} resolves to it; GLOO_SOCKET_IFNAME is unset"
    return "127.0.0.1", (f"the host name {hostname} resolves to no address of this machine, so gloo falls back to "
                         "loopback; GLOO_SOCKET_IFNAME is unset")


def ifname_set(env: Mapping[str, str]) -> bool:
    """Whether `env` names an interface for any of torch's transports (IFNAME_VARS): then the user chose."""
    return any(env.get(var, "").strip() for var in IFNAME_VARS)


def gloo_ifname(env: Mapping[str, str], address: str | None, ifaces: Mapping[str, Interface]) -> Interface | None:
    """Pure: the interface dualrun gives gloo (GLOO_SOCKET_IFNAME) on a job across machines: the one holding
    `address`, the address the other machines reach this one at (on torchrun its address on the route to machine 0,
    on Ray its node's address). None where `env` names an interface already (the user's value wins) or no interface
    here holds `address`. Why: unset, gloo binds what the host name resolves to, which is loopback on a machine
    whose /etc/hosts maps its name to 127.0.1.1 (Debian's default): the others cannot reach it, and the job fails or
    hangs in its first collective."""
    if ifname_set(env) or not address:
        return None
    found = owner(address, ifaces)
    return found if found is not None and found.address else None


def holding(address: str) -> str | None:
    """The name of this machine's interface that holds `address` (a Ray node's address, read where it runs)."""
    found = owner(address, interfaces())
    return found.name if found is not None and found.address else None
