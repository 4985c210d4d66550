"""Benchmarks start torchrun and Ray: they must only ever see the loopback interface, so no traffic can leave the
machine. Inside such a namespace they run; as root they re-execute themselves under `unshare -n`; else they stop."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys


def interfaces() -> set[str]:
    """The network interfaces of this process's namespace."""
    with open("/proc/net/dev") as f:
        return {line.split(":")[0].strip() for line in f.readlines()[2:]}


def ensure_loopback_only(argv: list[str]) -> None:
    """Return only inside a loopback-only namespace with `lo` up; as root re-exec this program (sys.argv[0] with
    `argv`) under `unshare -n`; else exit with a message."""
    name = os.path.basename(sys.argv[0]).removesuffix(".py") or "benchmark"
    if interfaces() <= {"lo"}:
        # a fresh `unshare -n` has `lo` down (check with netlink: /sys may still show the old namespace)
        shown = subprocess.run(["ip", "-o", "link", "show", "lo"], capture_output=True, text=True).stdout
        if ",UP" not in shown and "<UP" not in shown:
            r = subprocess.run(["ip", "link", "set", "lo", "up"], capture_output=True, text=True)
            if r.returncode != 0:
                sys.exit(f"{name}: the loopback interface is down and `ip link set lo up` failed: "
                         f"{r.stderr.strip()}")
        return
    if os.environ.get("DUALRUN_BENCH_UNSHARED") != "1" and os.geteuid() == 0 and shutil.which("unshare"):
        env = dict(os.environ, DUALRUN_BENCH_UNSHARED="1")
        os.execvpe("unshare", ["unshare", "-n", "--", sys.executable, os.path.abspath(sys.argv[0]), *argv], env)
    sys.exit(f"{name}: refusing to run: this benchmark starts torchrun and Ray and must only see the loopback "
             f"interface, but this namespace has {sorted(interfaces())}. Run it as root (it re-executes itself "
             "under `unshare -n`) or inside `unshare -n bash -c 'ip link set lo up; python "
             f"benchmarks/{name}.py ...'`.")
