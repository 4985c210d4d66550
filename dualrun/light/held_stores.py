"""Keep the rendezvous store of torchrun's agent listening after the agent returns.

Why: on several torchrun machines the agent store on machine 0 is the one channel to the other machines, and it
closes with the agent. A machine that runs no ranks (it only serves) has no agent of its own to tell it how the job
ended, so machine 0's launcher holds the store while it writes the job's result there and the serving machines
read it (backends/torchrun/serve_only.py). `held_stores()` appends every master TCPStore this process creates to a list:
a reference there keeps its server listening until the list is cleared.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

from dualrun.light.loopback_store import store_args, swapped_store_class


def _holding_class(real: Any, held: list[Any]) -> Any:
    class HeldTCPStore(real):   # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if store_args(args, kwargs).get("is_master"):
                held.append(self)

    HeldTCPStore.__qualname__ = HeldTCPStore.__name__ = "TCPStore"
    return HeldTCPStore


@contextlib.contextmanager
def held_stores() -> Iterator[list[Any]]:
    """While inside, every master TCPStore created in this process (torchrun's agent store) is appended to the
    list given; the caller drops them (`list.clear()`) once nobody needs the store any more."""
    held: list[Any] = []
    with swapped_store_class(lambda real: _holding_class(real, held)):
        yield held
