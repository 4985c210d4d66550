"""CPU-seconds of every process a launch starts, by process: /proc/<pid>/stat of the launch's process tree sampled
every `period_s`, each process's last reading kept (a process's CPU is its own, its threads included; what one does
after the last sample before it exits is lost, at most one period). On a shared machine a process's CPU-seconds are
steadier than the wall clock."""
from __future__ import annotations

import os
import threading
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: str) -> tuple[int, float, int] | None:
    """(ppid, user + system seconds, start time in ticks) of a process, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK, int(fields[19])


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


class TreeSampler:
    """Samples the tree under `root` (a pid) in a thread until `stop()`; `processes()` gives
    [{pid, cmd, cpu_s, start}] for every process seen in it, once a descendant always counted (Ray's daemons are
    re-parented when their starter exits)."""

    def __init__(self, root: int, period_s: float = 0.2) -> None:
        self.root, self.period_s = root, period_s
        self._seen: dict[tuple[int, int], dict] = {}
        self._pids: set[int] = {root}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        stats = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                s = _stat(name)
                if s is not None:
                    stats[int(name)] = s
        grew = True
        while grew:   # the tree: every process whose parent is in it
            grew = False
            for pid, (ppid, _, _) in stats.items():
                if pid not in self._pids and ppid in self._pids:
                    self._pids.add(pid)
                    grew = True
        for pid in self._pids & stats.keys():
            _, cpu, start = stats[pid]
            row = self._seen.get((pid, start))
            if row is None:
                row = self._seen[(pid, start)] = {"pid": pid, "ppid": stats[pid][0], "cmd": "", "cpu_s": 0.0,
                                                  "start": start}
            row["cmd"] = _cmdline(str(pid)) or row["cmd"]   # the latest: vLLM and Ray rename their processes
            row["cpu_s"] = max(row["cpu_s"], cpu)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.period_s)

    def stop(self) -> list[dict]:
        self._sample()
        self._stop.set()
        self._thread.join(timeout=10)
        return self.processes()

    def processes(self) -> list[dict]:
        return sorted(self._seen.values(), key=lambda r: r["start"])

