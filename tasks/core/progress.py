"""A small progress bar on stderr for long CLI work (silent when stderr is not a terminal)."""
from __future__ import annotations

import sys
import time


class ProgressBar:
    def __init__(self, total: int, label: str, stream=None):
        self.total = max(1, total)
        self.label = label
        self.stream = stream or sys.stderr
        self.done = 0
        self.started_s = time.monotonic()
        self.enabled = hasattr(self.stream, "isatty") and self.stream.isatty()

    def advance(self, steps: int = 1, note: str = "") -> None:
        self.done = min(self.total, self.done + steps)
        if not self.enabled:
            return
        width = 30
        filled = int(width * self.done / self.total)
        elapsed_s = time.monotonic() - self.started_s
        self.stream.write(
            f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
            f"{elapsed_s:5.1f}s {note[:40]:<40}"
        )
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
