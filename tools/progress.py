"""A progress line for long tools: done/total, rate and ETA for bulk ones (matrix, lint coverage,
diff), or the named stage for stepwise ones (run).

Drawn on stderr only when a person watches it (a TTY) and not `--quiet`, so logs and CI
output stay clean; redrawn at most a few times a second so drawing never costs the work.
"""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

_REDRAW_S = 0.2


class Progress:
    def __init__(self, total: int, label: str, stream: Optional[TextIO] = None, enabled: bool = True):
        self.total, self.label, self.done = total, label, 0
        self.stage_name: Optional[str] = None
        self._width = 0
        self.stream = stream or sys.stderr
        self.enabled = enabled and total > 0
        self._start = self._drawn = time.monotonic()

    def advance(self, count: int = 1) -> None:
        self.done += count
        now = time.monotonic()
        if self.enabled and (now - self._drawn >= _REDRAW_S or self.done >= self.total):
            self._drawn = now
            self._draw(now)

    def stage(self, name: str) -> None:
        """Start the next of `total` named stages (the one before it is done)."""
        if self.stage_name is not None:
            self.done += 1
        self.stage_name = name
        if self.enabled:
            self._draw(time.monotonic())

    def close(self) -> None:
        if self.enabled:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, now: float) -> None:
        if self.stage_name is not None:
            text = f"{self.label}: {min(self.done + 1, self.total)}/{self.total} {self.stage_name}"
        else:
            elapsed = max(now - self._start, 1e-9)
            rate = self.done / elapsed
            eta = (self.total - self.done) / rate if rate else 0.0
            text = f"{self.label}: {self.done}/{self.total} cells  {rate:,.0f} cells/s  ETA {eta:.0f}s"
        self.stream.write("\r" + text.ljust(self._width) + " ")  # padded over a longer previous line
        self._width = len(text)
        self.stream.flush()


def progress(total: int, label: str, quiet: bool = False, stream: Optional[TextIO] = None) -> Progress:
    """A bar that draws only on a TTY and not when quiet."""
    stream = stream or sys.stderr
    return Progress(total, label, stream, enabled=not quiet and stream.isatty())
