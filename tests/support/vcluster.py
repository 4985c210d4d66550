"""A virtual cluster on one host: N machines with addresses of their own on a private bridge, made of processes.

Why: a job across machines decides what its servers bind, which address each machine advertises, which interface
gloo uses and where the weight-sync group meets; on 127.0.0.1 every wrong answer still works. Here each machine has
its own network, so a wrong address fails as it would between real machines.

Layout (subnet 192.168.77.0/24: above 127.0.0.0 on purpose: of two gloo ranks the one with the higher address
dials the other, so a machine that advertises a loopback address (127.0.1.1 from Debian's /etc/hosts) fails here as
on any network above 127, where a 10.x network would hide it while one machine makes that mistake):
- machine K: a process made with `unshare` holding its own network, mount, PID and UTS namespaces. `eth0` has
  192.168.77.(K+1)/24, `lo` is up, the default route goes to the switch (192.168.77.254), the host name is `vcK`,
  and its /etc/hosts names every machine (vc0 192.168.77.1, vc1 192.168.77.2, ...). /tmp and /dev/shm are private tmpfs
  mounts (Ray keeps its session under /tmp: nothing is shared through them that two real machines would not
  share); the directories given as `shared` that lie under them are bound in at the same path, like a shared
  filesystem. /sys shows the machine's own interfaces. Everything else (the repository, the venv, $HOME) is the host's, as on machines with one image:
  a checkout or a venv that lies under /tmp (`image()`) is bound in at the same path too.
- the switch: a process with a network namespace of its own holding the bridge `br0` (192.168.77.254/24) and one
  veth port per machine, `port{K}`, whose other end is the machine's `eth0`. It has no other interface and does not
  forward: a packet for any other address ends there. Nothing is created in the namespace of the process that
  makes the cluster (a test keeps its loopback-only namespace).
Every namespace lives only as long as its process: each holder dies with `unshare` (`--kill-child`), which dies
with the process that started it (PR_SET_PDEATHSIG, so a SIGKILLed test leaves nothing), and a machine's PID
namespace takes every process of the machine with it. `kill(K)` is a machine lost: every process in it SIGKILLed.

From Python (tests):

    with VCluster(2, shared=[tmp_path]) as vc:
        p = vc.popen(1, ["python", "-c", "..."], env=env, cwd=tmp_path)   # a Popen, on machine 1
        vc.run(0, "ip -o addr")                                        # CompletedProcess (a str runs in sh -c)
        vc.cut(1); vc.restore(1)    # frames to and from machine 1 dropped silently (bridge port disabled)
        vc.slow(1, "8mbit")         # tbf both ways;  vc.link_down(1): the switch's port down (no carrier)
        vc.kill(1); vc.start(1)     # machine 1 lost, then back (fresh, same address)

By hand (as root):

    python tests/support/vcluster.py --machines 2 [--share DIR]... -- bash
        # in that shell: python tests/support/vcluster.py on 1 -- bash        (a shell on machine 1)
        #                python tests/support/vcluster.py net 1 cut|restore|down|slow RATE
Both need the cluster's pids, which the first command puts in VCLUSTER_PIDS and VCLUSTER_SWITCH. What runs inside the
namespaces (the holders, the entry shim) is tests/support/vcluster_ns.py.
"""
from __future__ import annotations

import argparse
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable, Sequence

import vcluster_ns
from vcluster_ns import PRIVATE

SUBNET = "192.168.77.0/24"
GATEWAY = "192.168.77.254"    # the bridge's address, in the switch's namespace: the machines' default route
KINDS = ("net", "mnt", "pid", "uts")
_START_S = 60.0            # a holder's set-up on a loaded machine (a fresh interpreter, a few mounts)


def address(machine: int) -> str:
    """Machine K's address on the cluster's subnet."""
    return f"192.168.77.{machine + 1}"


def hostname(machine: int) -> str:
    return f"vc{machine}"


def hosts_file(machines: int) -> str:
    """Every machine's /etc/hosts: its neighbours by name, as on a cluster whose names resolve."""
    lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
    return "\n".join(lines + [f"{address(k)} {hostname(k)}" for k in range(machines)]) + "\n"


def available() -> str | None:
    """None where a cluster can be made here (root, `unshare`, `nsenter`, `ip`, `bridge`, `tc`), else why not."""
    import shutil

    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs, a bridge)"
    missing = [t for t in ("unshare", "nsenter", "ip", "bridge", "tc") if shutil.which(t) is None]
    return f"needs {', '.join(missing)}" if missing else None


def under_private(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in PRIVATE)


def image() -> list[str]:
    """What every machine runs from, as machines with one image do: this checkout, this interpreter's environment and
    the venvs the tiers name. Bound back in where they lie under /tmp, which each machine's own tmpfs would hide."""
    named = [os.environ.get(v) for v in ("VIRTUAL_ENV", "DUALRUN_VENV", "DUALRUN_VLLM_VENV")]
    # and what this interpreter imports from there (a venv whose .pth names another venv's site-packages)
    imported = [p for p in sys.path if p and under_private(os.path.realpath(p))]
    return [str(Path(__file__).resolve().parents[2]), sys.prefix, sys.exec_prefix, *filter(None, named), *imported]


# -- the cluster, from the outside --------------------------------------------------------------------------------
INSIDE = str(Path(__file__).resolve().parent / "vcluster_ns.py")


def _shim(*args: str) -> list[str]:
    return [sys.executable, "-I", "-S", INSIDE, *args]


def _child_of(parent: int) -> int | None:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rpartition(")")[2].split()[1]) == parent:
                    return int(entry.name)
            except (OSError, ValueError, IndexError):
                continue
    return None


def _holder(unshare: list[str], hold_args: list[str]) -> tuple[subprocess.Popen, int]:
    """`unshare ... python vcluster.py _hold ...`: its process and the holder's pid, once the holder is ready."""
    proc = subprocess.Popen([*unshare, "--fork", "--kill-child=SIGKILL", "--", *_shim("_hold", *hold_args)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=vcluster_ns.die_with_parent)
    assert proc.stdout is not None
    deadline, said = time.monotonic() + _START_S, b""
    while b"ready\n" not in said and time.monotonic() < deadline and proc.poll() is None:
        if select.select([proc.stdout], [], [], 0.2)[0]:
            said += os.read(proc.stdout.fileno(), 4096)
    holder = _child_of(proc.pid) if b"ready\n" in said else None
    proc.stdout.close()
    if holder is None:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"vcluster: a holder did not start: {said.decode(errors='replace')[-2000:]}")
    return proc, holder


def _ip(pid: int, commands: Iterable[str], tool: str = "ip") -> None:
    """`ip -batch` (or `tc`/`bridge` one by one) in holder `pid`'s network namespace."""
    commands = list(commands)
    if tool == "ip":
        run = [["nsenter", "-t", str(pid), "-n", "ip", "-batch", "-"]]
        inputs = ["\n".join(commands) + "\n"]
    else:
        run = [["nsenter", "-t", str(pid), "-n", tool, *c.split()] for c in commands]
        inputs = [None] * len(run)
    for argv, text in zip(run, inputs):
        done = subprocess.run(argv, input=text, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"vcluster: {' '.join(argv)} {text or ''}failed: {done.stderr.strip()}")


def _until_up(pid: int, dev: str, timeout: float = 15.0) -> None:
    """Wait until `dev` (in holder `pid`'s namespace) is operationally up. The kernel refuses a bridge port's state
    while its carrier is still down ("Network is down"), and a carrier that comes back after `link set up` is
    reported by the kernel's link watch, deferred up to a second after the last change (longer on a loaded host)."""
    deadline = time.monotonic() + timeout
    while True:
        shown = subprocess.run(["nsenter", "-t", str(pid), "-n", "ip", "-o", "link", "show", "dev", dev],
                               capture_output=True, text=True, timeout=30).stdout
        if " state UP " in shown:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"vcluster: {dev} not up within {timeout:.0f} s: {shown.strip()}")
        time.sleep(0.05)


class VCluster:
    """N machines on one bridge (see the module's docstring). Start with `with VCluster(n) as vc:` or `start()`."""

    def __init__(self, machines: int, shared: Iterable[str | os.PathLike] = (), default_route: bool = True) -> None:
        self.size = machines
        wanted = [*shared, *(p for p in image() if os.path.isdir(p))]
        self.shared = sorted({os.path.realpath(p) for p in wanted if under_private(os.path.realpath(p))})
        self.default_route = default_route
        self.switch: tuple[subprocess.Popen, int] | None = None
        self.machines: dict[int, tuple[subprocess.Popen, int]] = {}
        self.made: set[str] = set()   # every namespace made, as /proc/PID/ns/* reads it ("net:[4026532...]")

    def __enter__(self) -> "VCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, machine: int | None = None) -> "VCluster":
        """The switch and every machine; or (again) only `machine`, e.g. after `kill`: fresh, same address."""
        if self.switch is None:
            self.switch = _holder(["unshare", "--net"], [])
            self._note(self.switch[1], ("net",))
            _ip(self.switch[1], ["link set lo up", "link add br0 type bridge", f"addr add {GATEWAY}/24 dev br0",
                                 "link set br0 up"])
        for k in range(self.size) if machine is None else [machine]:
            self._machine(k)
        return self

    def _machine(self, k: int) -> None:
        if k in self.machines:
            self.kill(k)
        held = _holder(["unshare", "--net", "--mount", "--pid", "--uts", "--mount-proc"],
                       ["--host", hostname(k), "--hosts", hosts_file(self.size), *self.shared])
        self.machines[k] = held
        self._note(held[1], KINDS)
        assert self.switch is not None
        _ip(self.switch[1], [f"link add port{k} type veth peer name eth0 netns {held[1]}",
                             f"link set port{k} master br0", f"link set port{k} up"])
        route = [f"route add default via {GATEWAY}"] if self.default_route else []
        _ip(held[1], ["link set lo up", f"addr add {address(k)}/24 dev eth0", "link set eth0 up", *route])

    def _note(self, pid: int, kinds: Sequence[str]) -> None:
        self.made |= {os.readlink(f"/proc/{pid}/ns/{kind}") for kind in kinds}

    # -- running things -------------------------------------------------------------------------------------
    def pid(self, machine: int) -> int:
        """The holder's pid (PID 1 of the machine), as this process sees it."""
        return self.machines[machine][1]

    def address(self, machine: int) -> str:
        return address(machine)

    def argv(self, machine: int, cmd: str | Sequence[str], cwd: str | os.PathLike | None = None) -> list[str]:
        """The command line that runs `cmd` on `machine` (a str runs in `sh -c`), for a Popen of one's own."""
        cmd = ["sh", "-c", cmd] if isinstance(cmd, str) else [str(c) for c in cmd]
        return _shim("on", str(machine), "--pid", str(self.pid(machine)), "--cwd", str(cwd or os.getcwd()),
                     "--", *cmd)

    def popen(self, machine: int, cmd: str | Sequence[str], *, cwd: str | os.PathLike | None = None,
              **kwargs) -> subprocess.Popen:
        """subprocess.Popen of `cmd` on `machine` (env, stdout, text... as Popen takes them). Its signals reach
        the command; killing it kills the command."""
        return subprocess.Popen(self.argv(machine, cmd, cwd), **kwargs)

    def run(self, machine: int, cmd: str | Sequence[str], *, timeout: float = 60, check: bool = False,
            cwd: str | os.PathLike | None = None, **kwargs) -> subprocess.CompletedProcess:
        """subprocess.run on `machine`; output captured as text unless told otherwise."""
        kwargs.setdefault("capture_output", "stdout" not in kwargs and "stderr" not in kwargs)
        kwargs.setdefault("text", True)
        return subprocess.run(self.argv(machine, cmd, cwd), timeout=timeout, check=check, **kwargs)

    def on_switch(self, cmd: str) -> str:
        """A command in the switch's namespace (to look at the bridge); its stdout."""
        assert self.switch is not None
        return subprocess.run(["nsenter", "-t", str(self.switch[1]), "-n", *cmd.split()], capture_output=True,
                              text=True, timeout=30, check=True).stdout

    # -- faults ---------------------------------------------------------------------------------------------
    def cut(self, machine: int) -> None:
        """Frames to and from `machine` are dropped at the switch, silently (its port disabled); its link stays up."""
        _ip(self._switch(), [f"link set dev port{machine} state 0"], tool="bridge")

    def link_down(self, machine: int) -> None:
        """The switch's port of `machine` down: its eth0 loses carrier (a pulled cable)."""
        _ip(self._switch(), [f"link set port{machine} down"])

    def slow(self, machine: int, rate: str, burst: str = "32kb", latency: str = "50ms") -> None:
        """`machine`'s link limited to `rate` both ways (tbf on the switch's port and on its eth0)."""
        spec = f"root tbf rate {rate} burst {burst} latency {latency}"
        _ip(self._switch(), [f"qdisc replace dev port{machine} {spec}"], tool="tc")
        _ip(self.pid(machine), [f"qdisc replace dev eth0 {spec}"], tool="tc")

    def restore(self, machine: int) -> None:
        """Undo `cut`, `link_down` and `slow`."""
        _ip(self._switch(), [f"link set port{machine} up"])
        _until_up(self._switch(), f"port{machine}")
        _ip(self._switch(), [f"link set dev port{machine} state 3"], tool="bridge")
        for pid, dev in ((self._switch(), f"port{machine}"), (self.pid(machine), "eth0")):
            subprocess.run(["nsenter", "-t", str(pid), "-n", "tc", "qdisc", "del", "dev", dev, "root"],
                           capture_output=True, timeout=30)   # none there: nothing to undo

    def _switch(self) -> int:
        assert self.switch is not None
        return self.switch[1]

    # -- ends -----------------------------------------------------------------------------------------------
    def kill(self, machine: int, timeout: float = 30) -> None:
        """SIGKILL every process of `machine` (its PID namespace goes with its first process) and wait for it."""
        proc, holder = self.machines.pop(machine)
        for pid in (holder, proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout)

    def close(self, timeout: float = 30) -> None:
        """Kill every machine, then the switch, and wait until no process holds any namespace they made (the
        kernel tears a PID namespace down after its first process has died)."""
        for k in list(self.machines):
            self.kill(k)
        if self.switch is not None:
            proc, holder = self.switch
            for pid in (holder, proc.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait(timeout)
            self.switch = None
        deadline = time.monotonic() + timeout
        while held(self.made) and time.monotonic() < deadline:
            time.sleep(0.05)


def held(namespaces: Iterable[str]) -> set[str]:
    """Which of `namespaces` some process still holds (none once a cluster is gone)."""
    wanted, found = set(namespaces), set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            for kind in KINDS:
                try:
                    ns = os.readlink(f"/proc/{entry.name}/ns/{kind}")
                except OSError:
                    continue
                if ns in wanted:
                    found.add(ns)
    return found


# -- command line -------------------------------------------------------------------------------------------------
def main(argv: list[str]) -> int:
    if argv[:1] == ["on"]:
        return vcluster_ns.main(argv)
    if argv[:1] == ["net"]:
        p = argparse.ArgumentParser(prog="vcluster.py net")
        p.add_argument("machine", type=int)
        p.add_argument("action", choices=["cut", "restore", "down", "slow"])
        p.add_argument("rate", nargs="?", default="8mbit")
        a = p.parse_args(argv[1:])
        pids, switch = vcluster_ns.pids_from_env()
        vc = VCluster(len(pids))
        vc.switch = (None, switch)  # type: ignore[assignment]
        vc.machines = {k: (None, pid) for k, pid in enumerate(pids)}  # type: ignore[misc]
        {"cut": vc.cut, "restore": vc.restore, "down": vc.link_down,
         "slow": lambda k: vc.slow(k, a.rate)}[a.action](a.machine)
        return 0
    p = argparse.ArgumentParser(prog="vcluster.py", description=__doc__.split("\n")[0])
    p.add_argument("--machines", type=int, default=2)
    p.add_argument("--share", action="append", default=[], help="a directory under /tmp every machine sees")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    with VCluster(a.machines, a.share) as vc:
        env = dict(os.environ, VCLUSTER_PIDS=",".join(str(vc.pid(k)) for k in range(a.machines)),
                   VCLUSTER_SWITCH=str(vc._switch()))
        for k in range(a.machines):
            print(f"vcluster: machine {k} {hostname(k)} {address(k)} (pid {vc.pid(k)})", file=sys.stderr)
        return subprocess.call(cmd or [os.environ.get("SHELL", "sh")], env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
