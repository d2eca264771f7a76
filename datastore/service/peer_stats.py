"""How a service's fetches from its peers went (either link): the time one was in flight and
the bytes they moved, and with ``$DATASTORE_PEER_STATS`` each fetch's messages and legs, as
``benchmarks/peers.py`` reads them."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

from datastore.service.peer_link import node_path

__all__ = ["STATS_ENV", "ExchangeStats", "read_stats"]

STATS_ENV = "DATASTORE_PEER_STATS"


class ExchangeStats:
    """When a service's fetches were in flight and what they moved: ``in_flight_s`` (the time
    at least one was), ``bytes``. With ``$DATASTORE_PEER_STATS`` set to a path (``{node}``:
    this service's rank), also each fetch's bytes, message sizes and legs (seconds from asked
    to the reply's envelope in, and from there to its last byte in) and each span in which one
    was in flight (``time.monotonic()``, the same clock in every process of a host), appended
    there as JSON lines (:func:`read_stats`): what ``benchmarks/peers.py`` measures the link by.
    A line per event costs the link the same at every fetch (rewriting one JSON document of
    them all cost the link's thread 12 ms per write after 600 fetches)."""

    def __init__(self, path: str, node: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = node_path(path, node) if path else ""
        self._clock = clock
        self.in_flight_s = 0.0
        self.bytes = 0
        self._active, self._since = 0, 0.0
        self._lock = threading.Lock()
        self._file: Any = None

    def begin(self) -> None:
        """A fetch was sent."""
        with self._lock:
            if not self._active:
                self._since = self._clock()
            self._active += 1

    def end(self, nbytes: int, sizes: list[int], legs: tuple[float, float] = (0.0, 0.0)) -> None:
        """A fetch is over, ``nbytes`` received in messages of ``sizes`` (0: it failed), in
        ``legs`` (envelope, bytes) seconds."""
        with self._lock:
            self._active -= 1
            self.bytes += nbytes
            if nbytes:
                self._log({"bytes": nbytes, "sizes": list(sizes), "legs": list(legs)})
            if not self._active:
                now = self._clock()
                self.in_flight_s += now - self._since
                self._log({"span": [self._since, now]})

    def _log(self, event: dict) -> None:
        if self.path:
            if self._file is None:
                self._file = open(self.path, "w", buffering=1)  # noqa: SIM115 - a line a write
            self._file.write(json.dumps(event) + "\n")

    def close(self) -> None:
        """Stop recording (a fetch still ending after this is not written)."""
        with self._lock:
            self.path = ""
            if self._file is not None:
                self._file.close()
                self._file = None


def read_stats(path: str) -> dict[str, Any]:
    """What an :class:`ExchangeStats` file holds so far: ``bytes``, ``in_flight_s``, ``spans``,
    and per fetch its message sizes (``fetches``) and ``legs``; all empty where there is no
    file yet (a line still being written is left out)."""
    out: dict[str, Any] = {"bytes": 0, "in_flight_s": 0.0, "spans": [], "fetches": [], "legs": []}
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return out
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if "span" in event:
            out["spans"].append(event["span"])
            out["in_flight_s"] += event["span"][1] - event["span"][0]
        else:
            out["bytes"] += event["bytes"]
            out["fetches"].append(event["sizes"])
            out["legs"].append(event["legs"])
    return out
