"""Multi-node torchrun: the servers' addresses travel through torchrun's own store, so servers take free ports.

Why: machines started by hand do not talk before the job, so machine 0's servers used to sit on
`main_process_port + 1 + i` for the others to guess (clashing with whatever held that port). Now every rank
already shares one store, torchrun's agent store at MASTER_ADDR:MASTER_PORT: local rank 0 of the machine that
started the servers publishes its trainer wiring env (the same on every machine: it depends only on the config
and the addresses), and the ranks of the other machines read it before the user's program starts.

Worker side, called by dualrun/rank/bootstrap.py; the launcher sets one of the two variables.
"""
from __future__ import annotations

import json
import os
from datetime import timedelta

from dualrun.protocol import WIRING_FETCH, WIRING_NAMES, WIRING_PUBLISH

_KEY = "dualrun/wiring"
_WAIT_S = 600.0


def _store():
    from torch.distributed import PrefixStore, TCPStore

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        raise RuntimeError("dualrun: the servers' addresses need torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE)")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                     timeout=timedelta(seconds=_WAIT_S))
    return PrefixStore(f"{_KEY}/attempt_{attempt}", store)


def share() -> None:
    """Publish (machine with the servers, local rank 0) or fetch (other machines) the trainer wiring env."""
    if os.environ.get(WIRING_PUBLISH) == "1":
        if os.environ.get("LOCAL_RANK", "0") == "0":
            names = json.loads(os.environ.get(WIRING_NAMES, "[]"))
            _store().set("env", json.dumps({k: os.environ[k] for k in names if k in os.environ}))
    elif os.environ.get(WIRING_FETCH) == "1":
        os.environ.update(json.loads(_store().get("env")))
