"""Structured logs: one JSON object per line on stderr (``ts``, ``level``, ``event``, fields)."""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any, TextIO

__all__ = ["JsonLog"]


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
            **fields,
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
