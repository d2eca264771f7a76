"""Channels to ``datastore serve`` and the calls the CLI makes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc

from datastore.service._pb.v1 import datastore_pb2 as pb
from datastore.service._pb.v1 import datastore_pb2_grpc as pb_grpc
from datastore.service.auth import bearer
from datastore.service.paths import unix_target

__all__ = ["Client"]


class Client:
    """A connection to one service, over its Unix socket or over TCP with a token.

    Args:
        socket: the Unix socket path (ignored with ``tcp``).
        tcp: ``HOST:PORT``. Default: none.
        token: the shared secret sent on every call (TCP). Default: none.
        timeout_s: deadline of each call. Default: ``5.0``.
    """

    def __init__(
        self,
        socket: Path | str | None = None,
        *,
        tcp: str | None = None,
        token: str | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        if tcp is None and socket is None:
            raise ValueError("a socket path or a TCP address is needed")
        self.target = tcp if tcp is not None else unix_target(socket)  # type: ignore[arg-type]
        self._channel = grpc.insecure_channel(self.target)
        self._stub = pb_grpc.DataStoreStub(self._channel)
        self._metadata = bearer(token) if token else None
        self._timeout = timeout_s

    def status(self) -> Any:
        """The ``Status`` reply."""
        return self._stub.Status(pb.StatusRequest(), timeout=self._timeout, metadata=self._metadata)

    def shutdown(self, *, grace_s: float = 0.0, reason: str = "") -> Any:
        """Ask the service to drain and exit."""
        return self._stub.Shutdown(
            pb.ShutdownRequest(grace_s=grace_s, reason=reason),
            timeout=self._timeout,
            metadata=self._metadata,
        )

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
