"""The errors a ``datastore`` user can catch, the same whether the store is embedded or remote.

Each is also the built-in exception a Python user would expect for it (``FileNotFoundError``
for a missing dataset, ``TimeoutError`` for a peer that does not answer...), so existing
``except`` clauses keep working.
"""

from __future__ import annotations

__all__ = [
    "DataStoreError",
    "DatasetNotFound",
    "ExchangeTimeout",
    "InsufficientMemory",
    "PathNotAllowed",
    "PeerFailed",
    "RankMismatch",
    "ServiceUnavailable",
]


class DataStoreError(Exception):
    """Base of every error ``datastore`` raises on purpose."""


class DatasetNotFound(DataStoreError, FileNotFoundError):
    """The dataset path does not exist (on this node, or on the service's)."""


class PathNotAllowed(DataStoreError, PermissionError):
    """The dataset lies outside the roots the service may serve (``--allow``)."""


class ServiceUnavailable(DataStoreError, ConnectionError):
    """No ``datastore serve`` answers at the address."""


class InsufficientMemory(DataStoreError, MemoryError):
    """The rank's share of the dataset does not fit in the memory available (refused before
    reading: set ``memory_budget`` and ``spill_dir``, or run more ranks)."""


class RankMismatch(DataStoreError, ValueError):
    """Ranks of one job disagree on an argument or the dataset (raised on every rank)."""


class PeerFailed(DataStoreError, RuntimeError):
    """A peer rank failed in the middle of a pass while this rank went on: its uncaught
    exception (in the message), or its connection closed (it exited or was killed)."""


class ExchangeTimeout(DataStoreError, TimeoutError):
    """A collective step did not complete within the loader's ``timeout``.

    Attributes:
        step: the step of the epoch being delivered (``-1``: before the first step).
        peers: the ranks still awaited, when known.
    """

    def __init__(self, message: str, step: int = -1, peers: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.step, self.peers = step, tuple(peers)

    @property
    def peer(self) -> int | None:
        """The first rank still awaited (``None``: unknown)."""
        return self.peers[0] if self.peers else None
