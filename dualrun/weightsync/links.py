"""The network link a member of the weight-sync group reaches the trainer through, and the speed the machine reports
for it, so `dualrun check` can print the rate it measured beside the rate the link is sold at.

Why: a sync moves the whole model every step; a user comparing "118 MB/s" with "link 1000 Mb/s = 125 MB/s" sees
whether the wire or something else is the limit. Linux reports a NIC's speed in /sys/class/net/IF/speed (Mb/s);
virtual links (loopback, most bridges, tunnels) report none, or an error on reading. Standard library only.
"""
from __future__ import annotations

import fcntl
import os
import socket
import struct
from typing import Mapping

SYS_NET = "/sys/class/net"
_SIOCGIFADDR = 0x8915


def interface_toward(address: str, env: Mapping[str, str] | None = None) -> str | None:
    """The interface this machine's traffic to `address` leaves through: the one gloo is told to use
    (GLOO_SOCKET_IFNAME, its first name), else the one holding the source address the kernel's route picks (no
    packet is sent). None where neither is found."""
    named = (env if env is not None else os.environ).get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if named:
        return named
    try:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((address, 9))
            local = s.getsockname()[0]
    except OSError:
        return None
    return interface_of(local)


def interface_of(local: str) -> str | None:
    """The interface that holds the address `local` (IPv4 through the kernel's SIOCGIFADDR, IPv6 from
    /proc/net/if_inet6)."""
    if ":" in local:
        want = socket.inet_pton(socket.AF_INET6, local.split("%")[0]).hex()
        try:
            with open("/proc/net/if_inet6") as f:
                for line in f:
                    fields = line.split()
                    if len(fields) >= 6 and fields[0] == want:
                        return fields[5]
        except OSError:
            return None
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == local:
                return name
    return None


def speed_mbps(interface: str, sys_net: str = SYS_NET) -> int | None:
    """The speed Linux reports for `interface` in Mb/s; None where it reports none (a virtual link, an unknown
    speed: -1 or a read error)."""
    try:
        with open(os.path.join(sys_net, interface, "speed")) as f:
            value = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return value if value > 0 else None


def link_toward(address: str, env: Mapping[str, str] | None = None) -> dict | None:
    """{"interface": name, "mbps": speed or None} of the link toward `address`; None where the interface is
    unknown."""
    interface = interface_toward(address, env)
    return None if interface is None else {"interface": interface, "mbps": speed_mbps(interface)}
