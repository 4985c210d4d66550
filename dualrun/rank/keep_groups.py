"""Every process group a rank makes stays alive until the rank's `os._exit` (worker side, both backends).

Why: freeing the last reference to a gloo group joins the group's worker threads. pybind releases the GIL when
Python drops a `ProcessGroup` itself, but not when C++ code that Python frees holds the last reference: DDP's
`Reducer` does, once `destroy_process_group()` (TRL's `trainer.end()`) has taken the group out of torch's registry,
so freeing the DDP model — e.g. when a script's `main()` returns — runs `~ProcessGroupGloo` with the GIL held. If a
gloo worker thread is at that moment freeing a finished collective whose tensors Python once held, it waits for the
GIL while the main thread waits for it to end: a deadlock inside the running program, before any exit hook
(pytorch/pytorch#56297). The rank's exit guard ends every rank with `os._exit`, which runs no destructor; holding
one more reference to each group here means no group is ever destroyed before that.

What is held: every group `destroy_process_group()` (or torch's `_abort_process_group()`) takes out of torch's
registry (groups still in it are held by torch itself), and every group a DDP model is built on (it may come from
outside the registry). The cost is a destroyed group's idle threads and sockets until the rank exits.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

_kept: list[Any] = []   # never emptied: the rank's os._exit is the only place these groups end


def kept() -> tuple[Any, ...]:
    return tuple(_kept)


def _keep(group: Any) -> None:
    if group is not None and not any(g is group for g in _kept):
        _kept.append(group)


def _registered(c10d: Any, group: Any) -> list[Any]:
    """The groups a destroy/abort of `group` takes out of torch's registry: all of them for the default group."""
    world = getattr(c10d, "_world", None)
    pg_map = getattr(world, "pg_map", None) or {}
    if group is None or group is getattr(c10d.GroupMember, "WORLD", None):
        return list(pg_map)
    return [group] if group in pg_map else []


def _keeping(c10d: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def keep_then(group: Any = None, *args: Any, **kwargs: Any) -> Any:
        for g in _registered(c10d, group):
            _keep(g)
        return original(group, *args, **kwargs)

    keep_then._dualrun_keeps = True  # type: ignore[attr-defined]
    return keep_then


def _hold_registry(module: Any) -> None:
    """torch.distributed imported: its destroy (both names) and abort keep the groups they drop."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    for name in ("destroy_process_group", "_abort_process_group"):
        original = getattr(c10d, name, None)
        if original is None or getattr(original, "_dualrun_keeps", False):
            continue
        wrapped = _keeping(c10d, original)
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapped)


def _hold_ddp(module: Any) -> None:
    """torch.nn.parallel.distributed imported: a DDP model's group is held from the model's construction."""
    ddp = getattr(module, "DistributedDataParallel", None)
    init = getattr(ddp, "__init__", None)
    if init is None or getattr(init, "_dualrun_keeps", False):
        return

    @functools.wraps(init)
    def init_then_keep(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        _keep(getattr(self, "process_group", None))

    init_then_keep._dualrun_keeps = True  # type: ignore[attr-defined]
    ddp.__init__ = init_then_keep


def activate() -> None:
    """Install both holds, now for what is imported already, else when it is imported."""
    from dualrun.rank.hooks import when_imported

    when_imported("torch.distributed", _hold_registry)
    when_imported("torch.nn.parallel.distributed", _hold_ddp)
