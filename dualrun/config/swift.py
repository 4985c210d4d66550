"""ms-swift's `device_groups` form, converted into dualrun `roles` + `colocate_groups`.

    device_groups:
      nproc_per_node: 4
      sample_group: {device: GPU, ranks: list(range(0, 2)), workers: [sampler]}
      rm_group:     {device: GPU, ranks: list(range(2, 4)), workers: [prm, orm]}

`ranks` is parsed (`list(range(a, b))`, `[0, 1]`, `'0,1'`, or an int meaning that many devices), never evaluated.
Workers listed together in one group share its devices, so they become a colocate group.
"""
from __future__ import annotations

from typing import Any

from dualrun.config.schema import MAX_DEVICE_ID, MAX_MACHINES, MAX_PROCESSES
from dualrun.config.values import check, parse_ids
from dualrun.contract.errors import ConfigError

_GROUP_KEYS = ("device", "ranks", "workers")


def convert_device_groups(source: str, raw: Any) -> tuple[dict[str, dict[str, Any]], list[list[str]],
                                                          dict[str, str]]:
    """(roles, colocate groups, the group each role came from: errors about a role name the group)."""
    if not isinstance(raw, dict):
        raise ConfigError(source, "device_groups", "a mapping of group names to {device, ranks, workers}", raw)
    roles: dict[str, dict[str, Any]] = {}
    groups: list[list[str]] = []
    origin: dict[str, str] = {}
    nproc = raw.get("nproc_per_node")
    if nproc is not None:
        nproc = check(source, "device_groups.nproc_per_node", "int", nproc, minimum=1, maximum=MAX_DEVICE_ID + 1)
    nnodes = raw.get("nnodes", 1)
    if raw.get("nnodes") is not None:
        nnodes = check(source, "device_groups.nnodes", "int", raw["nnodes"], minimum=1, maximum=MAX_MACHINES)
    for gname, group in raw.items():
        key = f"device_groups.{gname}"
        if gname in ("nproc_per_node", "nnodes"):
            continue
        if not isinstance(group, dict):
            raise ConfigError(source, key, "a mapping with device, ranks and workers", group)
        for k in group:
            if k not in _GROUP_KEYS:
                raise ConfigError(source, f"{key}.{k}", "one of device, ranks, workers", "an unknown key")
        device = str(group.get("device", "GPU")).upper()
        if device not in ("GPU", "CPU"):
            raise ConfigError(source, f"{key}.device", "GPU or CPU", group.get("device"))
        ranks = group.get("ranks")
        if ranks is None:
            raise ConfigError(source, f"{key}.ranks", "device ranks like list(range(0, 2)), [0, 1] or a count")
        if isinstance(ranks, int) and not isinstance(ranks, bool):
            ids, count = None, check(source, f"{key}.ranks", "int", ranks, minimum=1, maximum=MAX_PROCESSES)
        else:
            ids = parse_ids(source, f"{key}.ranks", ranks)
            count = len(ids or ())
        if device == "GPU" and isinstance(nproc, int) and isinstance(nnodes, int):
            ids = _node_local(source, f"{key}.ranks", ranks, ids, count, nproc, nnodes)
        workers = group.get("workers")
        if isinstance(workers, str):
            workers = [workers]
        if not isinstance(workers, list) or not workers or not all(isinstance(w, str) for w in workers):
            raise ConfigError(source, f"{key}.workers", "a non-empty list of role names", workers)
        for worker in workers:
            name = "train" if worker == "default" else worker
            if name in roles:
                raise ConfigError(source, f"{key}.workers", "each worker in one group only", worker)
            spec: dict[str, Any] = {"gpus": 0, "processes": count} if device == "CPU" else {"gpus": count}
            if ids is not None and device == "GPU":
                spec["gpu_ids"] = list(ids)
            roles[name] = spec
            origin[name] = str(gname)
        if len(workers) > 1:
            groups.append(["train" if w == "default" else w for w in workers])
    if not roles:
        raise ConfigError(source, "device_groups", "at least one group with workers")
    return roles, groups, origin


def _node_local(source: str, key: str, raw: Any, ids: tuple[int, ...] | None, count: int, nproc: int,
                nnodes: int) -> tuple[int, ...] | None:
    """ms-swift's ranks are global device indices (node = rank // nproc_per_node): check them against
    nproc_per_node * nnodes; a group on the first node keeps its device ids, one on (or spanning) other nodes
    keeps only its count and is placed by count like any role (dualrun's gpu_ids name devices of one node)."""
    limit = nproc * nnodes
    if (ids and max(ids) >= limit) or count > limit:
        raise ConfigError(source, key, f"device ranks below nproc_per_node * nnodes = {limit}", raw)
    if ids is None:
        return None
    return ids if max(ids) < nproc else None
