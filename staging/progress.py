"""Progress of a copy: a bar on a terminal (rich), JSON lines for programs, or nothing.

``--progress-json`` prints one object per line on stdout while copying::

    {"event": "progress", "bytes_done": 0, "bytes_total": 1048576}
    {"event": "progress", "bytes_done": 524288, "bytes_total": 1048576}
    {"event": "progress", "bytes_done": 1048576, "bytes_total": 1048576}

one when the copy starts, then at most one every ``interval_s`` (0.25 s) while bytes arrive,
and one when it ends (unless the last one already had the final counts); ``bytes_done``
never decreases. The counts are those of the process that
prints: under MPI only rank 0 prints, and its ``bytes_total`` is rank 0's share of the copy
(the summary that follows has the totals of every rank).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any, TextIO

__all__ = ["MIB", "Progress", "bar_columns", "human_bytes", "progress_line"]

INTERVAL_S = 0.25
MIB = 1 << 20
"""Sizes and rates for people are in binary units: KiB, MiB, GiB, and MiB/s."""


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def bar_columns() -> tuple[Any, ...]:
    """The progress bar's columns: bar, bytes done of the total, rate, time left; sizes and
    rate in binary units (rich's own rate column counts in MB/s)."""
    from rich.progress import BarColumn, ProgressColumn, TimeRemainingColumn
    from rich.text import Text

    class Bytes(ProgressColumn):
        def render(self, task: Any) -> Text:
            total = human_bytes(task.total) if task.total is not None else "?"
            return Text(f"{human_bytes(task.completed)} / {total}", style="progress.download")

    class Rate(ProgressColumn):
        def render(self, task: Any) -> Text:
            speed = task.finished_speed or task.speed
            shown = "?" if speed is None else f"{human_bytes(speed)}/s"
            return Text(shown, style="progress.data.speed")

    return BarColumn(), Bytes(), Rate(), TimeRemainingColumn()


def progress_line(bytes_done: int, bytes_total: int) -> str:
    """One ``--progress-json`` line (no newline)."""
    return json.dumps({"event": "progress", "bytes_done": bytes_done, "bytes_total": bytes_total})


class Progress:
    """Counts bytes from many threads; shows them as a rich bar when ``enabled``, or as JSON
    lines when ``json_lines`` (which wins over ``enabled``).

    Args:
        total: bytes to copy.
        enabled: draw a bar (on stderr; nothing when ``total`` is 0).
        json_lines: print progress lines instead. Default: ``False``.
        out: where JSON lines go. Default: ``sys.stdout`` at the time of printing.
        interval_s: least time between two lines while copying. Default: ``0.25``.
    """

    def __init__(
        self,
        total: int,
        enabled: bool,
        *,
        json_lines: bool = False,
        out: TextIO | None = None,
        interval_s: float = INTERVAL_S,
    ):
        self.total, self.enabled = total, enabled
        self.json_lines = json_lines
        self.done = 0
        self._out = out
        self._interval = interval_s
        self._last = 0.0
        self._last_done = -1
        self._lock = threading.Lock()
        self._bar: Any = None
        self._task: Any = None

    def _emit(self) -> None:
        """Print the current counts; the caller holds the lock (so lines stay in order)."""
        out = self._out or sys.stdout
        print(progress_line(self.done, self.total), file=out, flush=True)
        self._last, self._last_done = time.monotonic(), self.done

    def __enter__(self) -> Progress:
        if self.json_lines:
            with self._lock:
                self._emit()
        elif self.enabled and self.total:
            from rich.progress import Progress as Bar

            self._bar = Bar("staging", *bar_columns(), transient=True)
            self._bar.start()
            self._task = self._bar.add_task("staging", total=self.total)
        return self

    def advance(self, n: int) -> None:
        """Count ``n`` more bytes (from any thread)."""
        with self._lock:
            self.done += n
            if self._bar is not None:
                self._bar.advance(self._task, n)
            elif self.json_lines and time.monotonic() - self._last >= self._interval:
                self._emit()

    def __exit__(self, *exc: object) -> None:
        if self.json_lines:
            with self._lock:
                if self.done != self._last_done:  # else the last line has the final counts
                    self._emit()
        if self._bar is not None:
            self._bar.stop()
