"""A `main_process_port` another process holds, refused before anything starts: one line naming the key (the file's,
or `--main_process_port` when the flag gave it) and the port, exit 2.

Why: torch finds it only once the job runs, as an OSError from deep in its store (torchrun: `unexpected OSError
while starting the job`; Ray: `train rank 0 failed` seconds later). Only the process hosting the store binds the
port, so only it checks, on the address its store will bind (dualrun.light.ports.port_taken): torchrun's machine 0
(machines 1..N only connect to it); on Ray rank 0's node, from the driver where that node is this machine, and in
rank 0's actor before its program starts (`RankWorker.info`) wherever it is.
"""
from __future__ import annotations

from dualrun.contract.errors import ConfigError, Said
from dualrun.light.loopback_store import LOOPBACK_HOSTS
from dualrun.light.ports import EVERY_ADDRESS, port_taken
from dualrun.plan.meeting import Rendezvous

DEFAULT_PORT = 29500   # torchrun's rendezvous port on several machines when main_process_port is unset
THIS_MACHINE = "this machine"
RANK0_STORE = "trainer rank 0's store"
TORCHRUN_STORE = "machine 0's torchrun store"


def on_loopback(one_node: bool, master_addr: str) -> bool:
    """The store listens on loopback alone (one node, a loopback master address: light/loopback_store.py), else on
    every address."""
    return one_node and master_addr in LOOPBACK_HOSTS


def store_host(one_node: bool, master_addr: str = "127.0.0.1") -> str:
    """The address the rendezvous store binds: the loopback one, or every address."""
    return "127.0.0.1" if on_loopback(one_node, master_addr) else EVERY_ADDRESS


def taken_error(job: Rendezvous, port: int, why: str, where: str = THIS_MACHINE, who: str = "the job's store") -> \
        ConfigError:
    """The one line for `port` taken `where` (`why`: the bind's error), naming the key as the user gave it."""
    unset = "" if job.master_port else " (main_process_port unset: torchrun's default)"
    return ConfigError(*job.port_origin, f"a port free on {where} ({who} listens on it)",
                       Said(f"{port}{unset}, taken on {where} ({why})"),
                       hint="free it, or choose another port")


def refuse_taken(job: Rendezvous, port: int, host: str, who: str) -> None:
    """A ConfigError when `port` cannot be listened on at `host` on this machine."""
    why = port_taken(port, host)
    if why is not None:
        raise taken_error(job, port, why, who=who)
