"""Multi-node torchrun: the servers' addresses travel through torchrun's own store, so servers take free ports.

Why: machines started by hand do not talk before the job, and a separate role's servers may run on any of them.
Every rank can reach the store torchrun's agents share at `main_process_ip:main_process_port` (static rendezvous:
the agent store, MASTER_ADDR:MASTER_PORT; c10d: the rendezvous store): machine 0's launcher publishes the trainer
wiring env there once every server of every machine has its port, before any answers
(dualrun/backends/torchrun/machine_servers.py), and every rank of every machine reads it before the user's program
starts; a rank then waits for a server still starting where it first connects to it (dualrun/rank/server_wait.py).

Worker side, called by dualrun/rank/bootstrap.py; the launcher sets DUALRUN_WIRING_FETCH to the store's address.
"""
from __future__ import annotations

import json
import os

from dualrun.contract import job_store
from dualrun.contract.protocol import WIRING_FETCH


def share() -> None:
    """Fetch the trainer wiring env from the store (waits until machine 0's launcher has published it)."""
    where = os.environ.get(WIRING_FETCH)
    if not where:
        return
    host, _, port = where.rpartition(":")
    store = job_store.connect(host, int(port))
    os.environ.update(json.loads(store.get(job_store.WIRING_KEY)))
