"""Readable progress bars through a pipe: collapse carriage-return updates into a few whole lines.

Why: tqdm redraws its bar with '\\r' many times a second. On a terminal each redraw overwrites the last; through
the Ray backend's pipe every redraw became its own prefixed line, so an 8-step demo printed dozens of bars per
rank. A terminal shows, for each physical line, the last text drawn before its '\\n': that is what we print,
plus the pending bar at most every `interval_s` seconds while a long bar is still running (so it shows life).
Progress bars of ranks other than 0 are dropped by default (`DUALRUN_PROGRESS=all` shows every rank's, `none`
none); the rank's log file (`log_dir`) still gets every redraw.

Pure logic (no Ray, no torch): the Ray worker feeds it the bytes it reads and forwards what comes out.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Callable

MODES = ("rank0", "all", "none")
INTERVAL_S = 10.0
# what a tqdm bar looks like: "42%|####  | 3/8 [00:01<00:02, 2.1it/s]" or "3/8 [00:01<...]" (unknown total)
_BAR = re.compile(r"\d+%\||\d+(?:\.\d+)?[kMG]?/\d*(?:\.\d+)?[kMG]?\??\s*\[\d")


def looks_like_bar(text: str) -> bool:
    return bool(_BAR.search(text))


def show_progress(mode: str, rank: str | int | None) -> bool:
    """Whether this rank's bars go to the console under `mode` (unknown modes count as the default)."""
    mode = mode if mode in MODES else "rank0"
    if mode == "none":
        return False
    return mode == "all" or str(rank if rank is not None else "0") == "0"


@dataclass
class Collapser:
    """Feed raw text; get back the lines a reader wants (`raw` gets every segment, for the log file).

    A segment ended by '\\r' is a redraw that the next one replaces; a segment ended by '\\n' finishes the line
    (its shown text is the last non-blank segment since the previous '\\n')."""

    show_bars: bool = True
    interval_s: float = INTERVAL_S
    clock: Callable[[], float] = time.monotonic
    _buf: str = ""
    _pending: str = ""          # latest redraw of the unfinished line
    _redrawn: bool = False      # the unfinished line had a '\r'
    _shown: str | None = None   # what we last printed of the unfinished line
    _last_emit: float = field(default=-1e18)

    def feed(self, text: str, raw: Callable[[str], None] | None = None) -> list[str]:
        out: list[str] = []
        self._buf += text.replace("\r\n", "\n")
        while True:
            cut = min((i for i in (self._buf.find("\r"), self._buf.find("\n")) if i >= 0), default=-1)
            if cut < 0:
                break
            seg, end, self._buf = self._buf[:cut], self._buf[cut], self._buf[cut + 1:]
            if raw is not None and (seg or end == "\n"):
                raw(seg)
            if end == "\r":
                if seg.strip():
                    self._pending = seg
                self._redrawn = True
                continue
            self._finish(seg, out)
        if self._redrawn and self._pending and self._pending != self._shown and self.show_bars:
            now = self.clock()
            if now - self._last_emit >= self.interval_s:
                self._last_emit = now
                self._shown = self._pending
                out.append(self._pending)
        return out

    def close(self, raw: Callable[[str], None] | None = None) -> list[str]:
        """End of stream: what is left of the last line (a bar that never got its '\\n')."""
        out: list[str] = []
        if self._buf and raw is not None:
            raw(self._buf)
        if self._buf or self._pending:
            self._finish(self._buf, out)
        self._buf = ""
        return out

    def _finish(self, seg: str, out: list[str]) -> None:
        text = seg if (seg.strip() or not self._redrawn) else self._pending
        is_bar = self._redrawn and looks_like_bar(text)
        if not (is_bar and (not self.show_bars or text == self._shown)):
            out.append(text)
        if is_bar and self.show_bars:
            self._last_emit = self.clock()
        self._pending, self._redrawn, self._shown = "", False, None
