"""CPU seconds used by groups of process trees over a stretch of time: on a machine with few cores, whether a
result is bound by the wire or by the cores is read from these, not from the wall clock."""
from __future__ import annotations

import psutil


def _tree_seconds(pid: int, tree: bool = True) -> float:
    """User + system seconds of `pid` and (`tree`) every live descendant, their threads included; 0 when gone."""
    try:
        root = psutil.Process(pid)
        procs = [root] + (root.children(recursive=True) if tree else [])
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


class CpuMeter:
    """`groups`: {label: [root pids]}; `read()` gives {label: seconds} used since the previous `read()` (or since
    construction), so a caller brackets each measured stretch with two reads. Labels in `alone` count their pids
    without descendants (this process, whose children are other groups)."""

    def __init__(self, groups: dict[str, list[int]], alone: tuple[str, ...] = ()) -> None:
        self.groups, self.alone = groups, alone
        self._last = self._now()

    def _now(self) -> dict[str, float]:
        return {label: sum(_tree_seconds(pid, label not in self.alone) for pid in pids)
                for label, pids in self.groups.items()}

    def read(self) -> dict[str, float]:
        now = self._now()
        used = {label: round(now[label] - self._last[label], 4) for label in now}
        self._last = now
        return used
