"""A progress bar on a terminal (rich), nothing otherwise; byte counts for people."""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["Progress", "human_bytes"]


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class Progress:
    """Counts bytes from many threads; draws a rich bar only when ``enabled``."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled
        self._lock = threading.Lock()
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> Progress:
        if self.enabled and self.total:
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )
            from rich.progress import Progress as Bar

            self._bar = Bar(
                "staging",
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task("staging", total=self.total)
        return self

    def advance(self, n: int) -> None:
        if self._bar is not None:
            with self._lock:
                self._bar.advance(self._task, n)

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()
