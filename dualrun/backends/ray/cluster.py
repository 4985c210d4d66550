"""The Ray resource layer of the driver: join or start a cluster, place bundles, start and stop gangs of actors.

Below the launchers, the servers and the role runtime (all three use it; it imports none of them):
`connect` (address rules, embedded cluster, one-line errors), `placement` (fit check, PACK-then-SPREAD request,
a timeout that exits 2, waits that see signals) and `gang` (placement groups + actors, idempotent teardown).
"""
from __future__ import annotations

from dualrun.backends.ray.connect import (Connection, alive_nodes, check_reachable, cluster_of, connect, live_cluster,
                                        resolve_address)
from dualrun.backends.ray.gang import Gang, call_each
from dualrun.backends.ray.placement_groups import PLACEMENT_EXIT, check_resources, describe_free, place, placed, wait_refs

__all__ = ["Connection", "Gang", "call_each", "PLACEMENT_EXIT", "alive_nodes", "check_reachable", "check_resources", "cluster_of",
           "connect", "describe_free", "live_cluster", "place", "placed", "resolve_address", "wait_refs"]
