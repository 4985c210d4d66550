"""A one-node SLURM cluster for tests: munged, slurmctld and slurmd on 127.0.0.1, all state in one temp dir.

Installs Debian's `slurm-wlm` and `munge` when they are missing and this runs as root (CI does): apt-get runs in
the machine's own network namespace (the tests run in a loopback-only one). Stops only what it started, by pid.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

from dualrun.light.ports import free_port

NEEDED = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "sinfo", "srun", "scontrol")


def _missing() -> list[str]:
    return [b for b in NEEDED if shutil.which(b) is None and not Path(f"/usr/sbin/{b}").exists()]


def ensure_installed() -> str | None:
    """None when SLURM is usable, else why not (the reason a test skips with)."""
    if not _missing():
        return None
    if os.geteuid() != 0:
        return f"SLURM is not installed ({', '.join(_missing())} missing) and installing it needs root"
    import fcntl

    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    # apt-get fails at once on a lock another apt-get holds: wait for it instead
    wait = "-o DPkg::Lock::Timeout=600"
    install = f"apt-get update -q {wait} && apt-get install -y -q {wait} --no-install-recommends slurm-wlm munge"
    # one installer at a time: the main suite and the cluster tier run side by side and both may need it (in CI
    # both once skipped, their apt-gets in each other's way); the second finds it installed
    with open("/tmp/dualrun-slurm-install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _missing():
            return None
        # the loopback-only namespace has no network: the package manager runs in PID 1's namespace
        for prefix in ([], ["nsenter", "--net=/proc/1/ns/net"]):
            proc = subprocess.run(prefix + ["bash", "-c", install], env=env, capture_output=True, text=True,
                                  timeout=900)
            if proc.returncode == 0 and not _missing():
                return None
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    return f"could not install slurm-wlm and munge with apt-get: {tail[0]}"


CONF = """\
ClusterName=dualrun
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/sock
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SchedulerType=sched/builtin
MpiDefault=none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ReturnToService=2
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


class OneNodeSlurm:
    """Start with `start()`, submit with `sbatch()`, always `stop()`."""

    def __init__(self, root: Path, cpus: int | None = None) -> None:
        self.root = root
        self.cpus = cpus or os.cpu_count() or 1
        self.env = dict(os.environ, SLURM_CONF=str(root / "slurm.conf"))
        self.pids: list[int] = []

    def start(self) -> "OneNodeSlurm":
        r = self.root
        for d in ("state", "spool", "munge"):
            (r / d).mkdir(parents=True, exist_ok=True)
        os.chmod(r / "munge", 0o700)
        key = r / "munge" / "munge.key"
        subprocess.run(["mungekey", "-c", "-k", str(key)], check=True, capture_output=True)
        os.chmod(key, 0o400)
        # glibc's getaddrinfo(AI_ADDRCONFIG), which SLURM uses, resolves nothing while 127.0.0.1 is the only
        # IPv4 address; a second loopback address (on lo, in this test's own namespace) makes it resolve.
        subprocess.run(["ip", "addr", "add", "127.0.0.2/32", "dev", "lo"], capture_output=True)
        subprocess.run(["munged", "--force", "-S", str(r / "munge" / "sock"), "--key-file", str(key),
                        "--pid-file", str(r / "munge" / "pid"), "--log-file", str(r / "munge" / "log"),
                        "--seed-file", str(r / "munge" / "seed")], check=True, capture_output=True)
        self._remember(r / "munge" / "pid")
        (r / "slurm.conf").write_text(CONF.format(root=r, cpus=self.cpus, ctld_port=free_port(),
                                                  d_port=free_port()))
        subprocess.run(["slurmctld", "-i"], env=self.env, check=True, capture_output=True)
        self._remember(r / "slurmctld.pid")
        subprocess.run(["slurmd", "-N", "localhost"], env=self.env, check=True, capture_output=True)
        self._remember(r / "slurmd.pid")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            out = subprocess.run(["sinfo", "-h", "-o", "%t"], env=self.env, capture_output=True, text=True)
            if out.stdout.strip() == "idle":
                return self
            time.sleep(0.5)
        raise RuntimeError(f"the SLURM node never became idle: {self.logs()}")

    def _remember(self, pidfile: Path) -> None:
        deadline = time.monotonic() + 10
        while not (pidfile.exists() and pidfile.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.1)   # the daemon creates the file before it writes its pid
        self.pids.append(int(pidfile.read_text().split()[0]))

    def sbatch(self, script: Path, *options: str, env: dict[str, str], cwd: Path,
               timeout: float) -> tuple[int, str]:
        """Submit `script`, wait for the job; (its exit code, its output file's text)."""
        out = self.root / f"job-{time.monotonic_ns()}.out"
        proc = subprocess.run(["sbatch", "--wait", "-o", str(out), *options, str(script)], cwd=cwd,
                              env={**env, "SLURM_CONF": self.env["SLURM_CONF"]}, capture_output=True, text=True,
                              timeout=timeout)
        text = out.read_text(errors="replace") if out.exists() else ""
        return proc.returncode, text + proc.stderr

    def logs(self) -> str:
        return "".join((self.root / f).read_text(errors="replace")[-2000:]
                       for f in ("slurmctld.log", "slurmd.log") if (self.root / f).exists())

    def stop(self) -> None:
        for pid in reversed(self.pids):       # slurmd, slurmctld, then munged
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                os.kill(pid, signal.SIGKILL)
        self.pids = []


MACHINES_CONF = """\
ClusterName=dualrun
SlurmctldHost={head}({head_ip})
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=/tmp/munge/sock
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SchedulerType=sched/builtin
MpiDefault=none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ReturnToService=2
{nodes}
PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP
"""


class MachinesSlurm:
    """A SLURM cluster on the machines of a virtual cluster (tests/support/vcluster.py): slurmctld on machine 0, slurmd
    and munged on every machine (its socket in the machine's own /tmp, the key shared), each node named by its host name
    and reached at its address. Config, state and logs live in `root`, a directory every machine sees. Its daemons
    live as long as the machines (`VCluster.close` ends them)."""

    def __init__(self, vc, root: Path, cpus: int = 2) -> None:
        from vcluster import address, hostname

        self.vc, self.root, self.cpus = vc, root, cpus
        self.names = [hostname(k) for k in range(vc.size)]
        self.addresses = [address(k) for k in range(vc.size)]
        self.env = dict(os.environ, SLURM_CONF=str(root / "slurm.conf"))

    def start(self) -> "MachinesSlurm":
        r = self.root
        (r / "state").mkdir(parents=True, exist_ok=True)
        key = r / "munge.key"
        subprocess.run(["mungekey", "-c", "-k", str(key)], check=True, capture_output=True)
        os.chmod(key, 0o400)
        nodes = "\n".join(f"NodeName={n} NodeAddr={a} CPUs={self.cpus} State=UNKNOWN"
                          for n, a in zip(self.names, self.addresses))
        (r / "slurm.conf").write_text(MACHINES_CONF.format(root=r, head=self.names[0], head_ip=self.addresses[0],
                                                           nodes=nodes, names=",".join(self.names)))
        for k in range(self.vc.size):
            self._run(k, f"mkdir -m 700 -p /tmp/munge && munged --force -S /tmp/munge/sock --key-file {key} "
                         "--pid-file /tmp/munge/pid --log-file /tmp/munge/log --seed-file /tmp/munge/seed")
        self._run(0, "slurmctld -i")
        for k, name in enumerate(self.names):
            self._run(k, f"slurmd -N {name}")
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            out = self.vc.run(0, ["sinfo", "-h", "-o", "%t"], env=self.env)
            if out.stdout.split() == ["idle"]:
                return self
            time.sleep(0.5)
        raise RuntimeError(f"the SLURM nodes never became idle: {self.logs()}")

    def _run(self, machine: int, cmd: str) -> None:
        done = self.vc.run(machine, cmd, env=self.env, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"machine {machine}: {cmd}: {done.stderr.strip()[-2000:]} {self.logs()}")

    def sbatch(self, script: Path, *options: str, env: dict[str, str], cwd: Path,
               timeout: float) -> tuple[int, str]:
        """Submit `script` on machine 0 and wait for the job; (its exit code, its output file's text). The job's state
        is read twice a second (`sbatch --wait` backs off to 30 s between its looks)."""
        out = self.root / f"job-{time.monotonic_ns()}.out"
        env = {**env, "SLURM_CONF": self.env["SLURM_CONF"]}
        proc = self.vc.run(0, ["sbatch", "--parsable", "-o", str(out), *options, str(script)], cwd=cwd, env=env)
        assert proc.returncode == 0, proc.stderr
        job, deadline, state = proc.stdout.strip().split(";")[0], time.monotonic() + timeout, {}
        while time.monotonic() < deadline:
            shown = self.vc.run(0, ["scontrol", "-o", "show", "job", job], env=env).stdout
            state = dict(f.split("=", 1) for f in shown.split() if "=" in f)
            if state.get("JobState") not in (None, "PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
                break
            time.sleep(0.5)
        else:
            self.vc.run(0, ["scancel", job], env=env)
        text = out.read_text(errors="replace") if out.exists() else ""
        code = int(state.get("ExitCode", "1:0").split(":")[0]) if state.get("JobState") == "COMPLETED" else 1
        return code, text + f"\n(job {job}: {state.get('JobState')}, exit code {state.get('ExitCode')})"

    def logs(self) -> str:
        return "".join(f"--- {f.name}\n" + f.read_text(errors="replace")[-2000:]
                       for f in sorted(self.root.glob("slurm*.log")))


@contextlib.contextmanager
def one_node_slurm(prefix: str) -> "Iterator[OneNodeSlurm]":
    """A started one-node SLURM cluster for a module's tests (2 CPUs, its state in a fresh /tmp/<prefix>* dir), or
    the test skipped with the reason: outside the loopback-only namespace, or where SLURM cannot be installed."""
    import pytest

    from helpers import loopback_only

    if not loopback_only():
        pytest.skip("a SLURM cluster is started only inside the loopback-only namespace")
    why = ensure_installed()
    if why:
        pytest.skip(why)
    root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    cluster = OneNodeSlurm(root, cpus=2)
    try:
        yield cluster.start()
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def two_node_slurm(shared: Path, *more: Path, routed_out: bool = False) -> "Iterator[MachinesSlurm]":
    """A SLURM cluster on two machines of a virtual cluster that see `shared` and `more`, machine 0's /etc/hosts
    Debian's (its own name on loopback there); `routed_out`: each machine's route out on an interface the other
    does not reach. Skipped with the reason where SLURM cannot be installed."""
    import pytest

    from cluster_jobs import debian_hosts, route_out_elsewhere
    from vcluster import VCluster

    why = ensure_installed()
    if why:
        pytest.skip(why)
    with VCluster(2, shared=[shared, *more]) as vc:
        debian_hosts(vc, 0)
        if routed_out:
            route_out_elsewhere(vc)
        yield MachinesSlurm(vc, shared / "slurm").start()


def dualrun_in_sbatch(cluster: "MachinesSlurm", work: Path, launch: list[str], tasks_per_node: int = 1,
                      timeout: float = 800) -> tuple[int, str]:
    """`dualrun launch --backend slurm LAUNCH` as an sbatch script's one command, run from `work` on both nodes
    (`tasks_per_node` task slots each): (its exit code, its output)."""
    import shlex
    import sys

    from cluster_jobs import ENV

    script = work / "job.sh"
    script.write_text(f"#!/bin/bash\ncd {work}\nexec {sys.executable} -m dualrun launch --backend slurm "
                      + " ".join(shlex.quote(a) for a in launch) + "\n")
    env = {**{k: v for k, v in cluster.env.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}, **ENV}
    return cluster.sbatch(script, "--nodes=2", f"--ntasks-per-node={tasks_per_node}", env=env, cwd=work,
                          timeout=timeout)
