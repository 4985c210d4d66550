"""torchrun's agent store as the one channel between machines started by hand: key names and the client, for the
launchers (driver side) and the ranks (worker side) alike.

Why this store: the machines of a multi-machine torchrun job do not talk before the job; the first thing they
share is the TCPStore that torchrun's agent on machine 0 serves at `main_process_ip:main_process_port` once the
rendezvous begins (static rendezvous, the default: it lives as long as that agent, across torchrun's own worker
restarts, so the keys below need no attempt number; a restart dualrun makes itself runs a new agent, a new store,
which machine 0 marks with `ATTEMPT_KEY` so that machine K does not join the ending attempt's store).
Whoever reaches that store reads every key, the job's secret (`TOKEN_KEY`) included, as they could join torchrun's
rendezvous itself: the store's port is the job's trust boundary across machines.
"""
from __future__ import annotations

from datetime import timedelta

RESERVED_KEY = "dualrun/reserved/{index}"   # `host:port` of plan.servers[index] (routers too), set by its machine
                                        # as soon as its port is picked, before it answers (the trainers' wiring)
SERVER_KEY = "dualrun/server/{index}"   # the same once it answered (the other machines' health checks begin),
FAILED = "failed: "                     # or this prefix and one line when it did not start there
TOKEN_KEY = "dualrun/job_token"        # the job's secret machine 0 made, for the other machines' servers and ranks
                                        # (empty: the user set DUALRUN_JOB_TOKEN there, which is not handed out)
WIRING_KEY = "dualrun/wiring/env"       # JSON: the trainers' wiring env, set by machine 0 once every address is
                                        # known (with DUALRUN_SERVERS_STARTING while the servers still start)
FINISHED_KEY = "dualrun/finished/{machine}"   # set by a machine whose ranks succeeded, before it stops its servers
ATTEMPT_KEY = "dualrun/attempt"         # set by machine 0 in each attempt's store: which dualrun attempt it serves
BEAT_KEY = "dualrun/beat/{machine}"     # machine K's launcher adds 1 every second (backends/torchrun/machine_watch.py)
MACHINE_KEY = "dualrun/machine/{machine}"   # machine K's address on its route to machine 0
LEFT_KEY = "dualrun/left/{machine}"     # set by machine K's launcher once its agent returned: its silence is no loss
RESULT_KEY = "dualrun/result"           # JSON {exit_code, message, restart}: set by machine 0's launcher once its
                                        # agent returned, for the machines that run no ranks
                                        # (backends/torchrun/serve_only.py)
JOIN_KEY = "dualrun/join/{machine}"     # JSON {index: address}: an optional serving machine's replicas, set once
                                        # they answered (backends/torchrun/machine_fleet.py): machine 0 takes them in
LEAVING_KEY = "dualrun/leaving/{machine}"   # ... why it leaves (SIGTERM): machine 0 drains its replicas, then
LET_GO_KEY = "dualrun/let_go/{machine}"     # machine 0 sets this: they are out of rotation, drained; stop them
WAIT_S = 600.0                          # how long a reader waits for a key (machines are started by hand)


def connect(host: str, port: int, timeout_s: float = WAIT_S):
    """A client of the store at `host:port`; it waits (up to `timeout_s`) for the store to exist, and every
    `get` waits as long for its key."""
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def listening(host: str, port: int) -> bool:
    """Whether the store still listens (a plain connect: a TCPStore client retries for its whole timeout)."""
    import socket

    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def server_key(index: int) -> str:
    return SERVER_KEY.format(index=index)


def reserved_key(index: int) -> str:
    return RESERVED_KEY.format(index=index)


def finished_key(machine: int) -> str:
    return FINISHED_KEY.format(machine=machine)


def beat_key(machine: int) -> str:
    return BEAT_KEY.format(machine=machine)


def machine_key(machine: int) -> str:
    return MACHINE_KEY.format(machine=machine)


def left_key(machine: int) -> str:
    return LEFT_KEY.format(machine=machine)


def join_key(machine: int) -> str:
    return JOIN_KEY.format(machine=machine)


def leaving_key(machine: int) -> str:
    return LEAVING_KEY.format(machine=machine)


def let_go_key(machine: int) -> str:
    return LET_GO_KEY.format(machine=machine)
