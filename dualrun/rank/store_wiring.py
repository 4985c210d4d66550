"""Multi-node torchrun: the servers' addresses travel through torchrun's own store, so servers take free ports.

Why: machines started by hand do not talk before the job, and a separate role's servers may run on any of them.
Every rank already shares one store, torchrun's agent store at MASTER_ADDR:MASTER_PORT: machine 0's launcher
publishes the trainer wiring env there once every server of every machine answers (dualrun/servers/machines.py),
and every rank of every machine reads it before the user's program starts, so no rank uses an address early.

Worker side, called by dualrun/rank/bootstrap.py; the launcher sets DUALRUN_WIRING_FETCH.
"""
from __future__ import annotations

import json
import os

from dualrun import job_store
from dualrun.protocol import WIRING_FETCH


def share() -> None:
    """Fetch the trainer wiring env from the store (waits until machine 0's launcher has published it)."""
    if os.environ.get(WIRING_FETCH) != "1":
        return
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        raise RuntimeError("dualrun: the servers' addresses need torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE)")
    store = job_store.connect(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    os.environ.update(json.loads(store.get(job_store.WIRING_KEY)))
