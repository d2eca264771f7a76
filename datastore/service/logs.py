"""Structured logs: one JSON object per line on stderr (``ts``, ``level``, ``event``, fields).

A field may carry what a client sent (a job id, a stage's paths): a string is cut after
:data:`MAX_CHARS` characters and a list after :data:`MAX_ITEMS` items, each saying how long it
was, so no client can make a line megabytes long.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any, TextIO

__all__ = ["MAX_CHARS", "MAX_ITEMS", "JsonLog"]

MAX_CHARS = 1000
"""The most characters of a string field a line holds."""
MAX_ITEMS = 100
"""The most items of a list field a line holds."""


def _bounded(value: Any) -> Any:
    if isinstance(value, str) and len(value) > MAX_CHARS:
        return f"{value[:MAX_CHARS]}... ({len(value)} characters)"
    if isinstance(value, list):
        items = [_bounded(v) for v in value[:MAX_ITEMS]]
        return items if len(value) <= MAX_ITEMS else [*items, f"... ({len(value)} items)"]
    return value


class JsonLog:
    """Writes ``{"ts": ..., "level": ..., "event": ..., **fields}`` lines, one per call.

    Args:
        stream: where to write. Default: ``sys.stderr`` (looked up at each call).
        component: added to every line as ``"component"``. Default: ``"serve"``.
    """

    def __init__(self, stream: TextIO | None = None, component: str = "serve") -> None:
        self._stream = stream
        self._component = component
        self._lock = threading.Lock()

    def emit(self, level: str, event: str, **fields: Any) -> None:
        record = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
            + f".{int(time.time() * 1000) % 1000:03d}Z",
            "level": level,
            "component": self._component,
            "event": event,
            **{k: _bounded(v) for k, v in fields.items()},
        }
        line = json.dumps(record, default=str, separators=(",", ":"))
        stream = self._stream or sys.stderr
        with self._lock:
            stream.write(line + "\n")
            stream.flush()

    def info(self, event: str, **fields: Any) -> None:
        self.emit("info", event, **fields)

    def warning(self, event: str, **fields: Any) -> None:
        self.emit("warning", event, **fields)

    def error(self, event: str, **fields: Any) -> None:
        self.emit("error", event, **fields)
