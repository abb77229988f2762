"""A one-line progress bar (carriage return, no dependency), only on a terminal."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """`update()` after each finished request; redraws at most every `min_interval` s."""

    def __init__(
        self,
        total: int,
        stream: TextIO | None = None,
        enabled: bool | None = None,
        min_interval: float = 0.2,
    ):
        self.total = total
        self.stream = stream or sys.stdout
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.min_interval = min_interval
        self.done = 0
        self.failed = 0
        self._start = time.monotonic()
        self._last_draw = 0.0

    def update(self, success: bool) -> None:
        self.done += 1
        self.failed += not success
        now = time.monotonic()
        if self.enabled and (now - self._last_draw >= self.min_interval or self.done == self.total):
            self._last_draw = now
            self.stream.write("\r" + self.line(now - self._start))
            self.stream.flush()

    def line(self, elapsed: float, width: int = 30) -> str:
        frac = self.done / self.total if self.total else 1.0
        bar = "#" * int(frac * width)
        return f"[{bar:<{width}}] {self.done}/{self.total} done, {self.failed} failed, {elapsed:6.1f} s"

    def close(self) -> None:
        if self.enabled and self.done:
            self.stream.write("\n")
            self.stream.flush()
