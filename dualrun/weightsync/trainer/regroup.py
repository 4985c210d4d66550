"""Re-form TRL's weight-sync group when the rollout router's weight-transfer members changed (a replica died, or its
replacement joined), before the next sync: the trainer's side of "no replica serves stale weights".

Why: TRL's `VLLMClient` forms its group once (`init_communicator`: the trainer rank 0 plus every engine worker, the
world size from `/get_world_size`) and broadcasts into it at every sync. Behind dualrun's router the engines may
change while training goes on: a dead replica in the group would fail the broadcast, and a restarted one is not in
it. The router numbers its members (`protocol.ROUTER_MEMBERSHIP_PATH`, dualrun/programs/rotation.py); before a sync this compares
the number with the one the group was formed under and, changed, closes the trainer's side, has every current
member leave the old group (vLLM's `/shutdown_weight_transfer_engine`, fanned out by the router), and forms the
group again on a fresh port with the members of now. A restarted replica thus joins at the next sync and, held out
of rotation by the router until then, serves only once it holds the trainer's weights.

Backend-neutral: it drives TRL's own `close_communicator` / `init_communicator` (NCCL on GPUs, or dualrun's gloo
path installed beside it, dualrun/weightsync/trainer/vllm_client.py). Against a single engine (no router: 404) nothing changes.

What it does not cover: a replica that dies while the trainer is inside a sync (between this check and the end of
the broadcast). The collective then fails (gloo: the peer's connection closes; NCCL: the collective timeout), the
sync's call raises naming the replica the router could not reach, and the attempt ends like any trainer failure:
`max_failures` restarts it from its last checkpoint.
"""
from __future__ import annotations

import sys
from typing import Any

from dualrun.contract.protocol import ROUTER_MEMBERSHIP_PATH

SHUTDOWN_PATH = "/shutdown_weight_transfer_engine"   # vLLM's dev-mode route: an engine leaves its trainer's group
_MEMBERSHIP = "_dualrun_membership"   # on the client: the membership its group was formed under (None: no router)
_DEVICE = "_dualrun_device"           # on the client: the device `init_communicator` was given


def membership(client: Any) -> int | None:
    """The router's membership number; None from a server that is no dualrun router (it answers 404)."""
    response = client.session.get(f"{client.base_url}{ROUTER_MEMBERSHIP_PATH}", timeout=60)
    if response.status_code == 404:
        return None
    if response.status_code != 200:
        raise RuntimeError(f"the rollout router at {client.base_url} answered {response.status_code} to "
                           f"{ROUTER_MEMBERSHIP_PATH}: {response.text[:500]}")
    return int(response.json()["membership"])


def needs_reform(formed_under: int | None, now: int | None, has_group: bool, updating: bool) -> bool:
    """Pure: whether the group must be formed again before this sync: it exists, was formed behind a router, the
    router's membership changed since, and no update is open (TRL's `weight_update()` block: its members were told
    to start it; the check waits for the next call)."""
    return has_group and not updating and formed_under is not None and now is not None and now != formed_under


def remember(client: Any, device: Any) -> None:
    """Before `init_communicator` forms the group: the membership it is formed under, and the device (to form it
    again the same way)."""
    setattr(client, _DEVICE, device)
    setattr(client, _MEMBERSHIP, membership(client))


def reform_if_changed(client: Any) -> bool:
    """Before a sync: re-form the group when the router's membership changed (see the module's docstring). True
    when it did."""
    formed_under = getattr(client, _MEMBERSHIP, None)
    if formed_under is None or client.communicator is None or client._updating_weights:
        return False
    now = membership(client)
    if not needs_reform(formed_under, now, client.communicator is not None, client._updating_weights):
        return False
    from dualrun.light.ports import free_port

    print(f"dualrun: the rollout router's weight-transfer members changed (membership {formed_under} -> {now}): "
          "re-forming the weight-sync group before this sync", file=sys.stderr, flush=True)
    client.close_communicator()
    client._post(f"{client.base_url}{SHUTDOWN_PATH}", json={})
    client.group_port = free_port("0.0.0.0", avoid={client.group_port})   # the old group's store may hold it
    client.init_communicator(getattr(client, _DEVICE, 0))
    return True
