"""What runs inside the virtual cluster's namespaces (tests/support/vcluster.py makes them): a holder, the first process
of a machine (or of the switch), and the entry shim that runs a command on a machine.

Both run as `python -I -S tests/support/vcluster_ns.py ...`: the standard library only (ctypes for setns, mount and
prctl), so they start fast and import nothing of the project or the venv.

    python -I -S tests/support/vcluster_ns.py _hold [--host NAME --hosts TEXT] [SHARED_DIR...]   (under unshare)
    python -I -S tests/support/vcluster_ns.py on K [--pid PID] [--cwd DIR] -- CMD...
"""
from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
from pathlib import Path
from typing import Sequence

PRIVATE = ("/tmp", "/dev/shm")   # a tmpfs of each machine's own
_CLONE = {"mnt": 0x00020000, "uts": 0x04000000, "pid": 0x20000000, "net": 0x40000000}
_MS_NOSUID, _MS_NODEV, _MS_BIND, _MS_REC = 0x2, 0x4, 0x1000, 0x4000
_PR_SET_PDEATHSIG = 1


# -- the kernel calls (ctypes: the holders and the entry shim run with `python -I -S`, no third-party code) --------
def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_libc().mount(source.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                         data.encode() if data else None), f"mount {source} on {target}")


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    _libc().prctl(_PR_SET_PDEATHSIG, sig)


# -- inside a holder (the process `unshare` starts: PID 1 of a machine, or the switch) ------------------------------
def hold(host: str | None, shares: Sequence[str], hosts: str | None) -> None:
    """Set the machine up (private /tmp and /dev/shm, the shared directories bound back in, its host name and
    /etc/hosts), say `ready`, then reap orphans until killed. The switch (no `host`) only waits."""
    if host is not None:
        fds = {d: os.open(d, os.O_RDONLY | os.O_DIRECTORY) for d in shares}   # before the tmpfs hides them
        for where in PRIVATE:
            _mount("tmpfs", where, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=1777")
        # /sys as this network namespace shows it (/sys/class/net: its own interfaces), the cgroups bound back
        cgroup = os.open("/sys/fs/cgroup", os.O_RDONLY | os.O_DIRECTORY) if os.path.isdir("/sys/fs/cgroup") else None
        _mount("sysfs", "/sys", "sysfs", _MS_NOSUID | _MS_NODEV)
        if cgroup is not None:
            _mount(f"/proc/self/fd/{cgroup}", "/sys/fs/cgroup", None, _MS_BIND | _MS_REC)
            os.close(cgroup)
        for d in sorted(shares, key=len):
            os.makedirs(d, exist_ok=True)
            _mount(f"/proc/self/fd/{fds[d]}", d, None, _MS_BIND | _MS_REC)
            os.close(fds[d])
        import socket

        socket.sethostname(host)
        os.makedirs("/tmp/.vcluster", exist_ok=True)
        Path("/tmp/.vcluster/hosts").write_text(hosts or "")
        _mount("/tmp/.vcluster/hosts", "/etc/hosts", None, _MS_BIND)
    print("ready", flush=True)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])
    while True:   # PID 1 of the machine: orphans (daemons) are re-parented here
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            pass
        signal.sigtimedwait([signal.SIGCHLD], 5.0)


def enter(pid: int, cwd: str, argv: list[str]) -> None:
    """The entry shim: join holder `pid`'s namespaces, run `argv` there as a child (the first process of the
    machine's PID namespace sees only the machine), pass on every signal it gets, and end as the child ended (its
    exit code, or killed by the same signal). The child is SIGKILLed if the shim is."""
    fds = [(os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY), _CLONE[kind]) for kind in ("uts", "net", "pid", "mnt")]
    for fd, flag in fds:
        _check(_libc().setns(fd, flag), f"setns {flag:#x} of pid {pid}")
        os.close(fd)
    child = os.fork()
    if child == 0:
        try:
            die_with_parent()
            os.chdir(cwd if os.path.isdir(cwd) else "/")
            os.execvp(argv[0], argv)
        except OSError as e:
            print(f"vcluster: {argv[0]}: {e.strerror}", file=sys.stderr, flush=True)
        os._exit(127)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
                signal.SIGWINCH, signal.SIGCONT):
        signal.signal(sig, lambda s, _f: os.kill(child, s))
    _, status = os.waitpid(child, 0)
    if os.WIFSIGNALED(status):
        import resource

        sig = os.WTERMSIG(status)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
    sys.exit(os.waitstatus_to_exitcode(status))


def pids_from_env() -> tuple[list[int], int]:
    """The holders' pids of the cluster this shell was started in (`python tests/support/vcluster.py ... -- CMD`)."""
    pids, switch = os.environ.get("VCLUSTER_PIDS"), os.environ.get("VCLUSTER_SWITCH")
    if not pids or not switch:
        sys.exit("vcluster: no cluster here: start one with `python tests/support/vcluster.py --machines N -- CMD`")
    return [int(p) for p in pids.split(",")], int(switch)


def main(argv: list[str]) -> int:
    if argv[:1] == ["_hold"]:
        p = argparse.ArgumentParser()
        p.add_argument("--host")
        p.add_argument("--hosts")
        p.add_argument("shares", nargs="*")
        a = p.parse_args(argv[1:])
        hold(a.host, a.shares, a.hosts)
        return 0
    if argv[:1] == ["on"]:   # on K [--pid PID] [--cwd DIR] -- CMD...
        head, cmd = (argv[1:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv[1:], [])
        p = argparse.ArgumentParser(prog="vcluster.py on")
        p.add_argument("machine", type=int)
        p.add_argument("--pid", type=int)
        p.add_argument("--cwd", default=os.getcwd())
        a = p.parse_args(head)
        enter(a.pid or pids_from_env()[0][a.machine], a.cwd, cmd or ["sh"])
        return 0
    sys.exit(f"vcluster_ns: unknown command {argv[:1]}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
