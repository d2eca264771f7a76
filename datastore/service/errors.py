"""The one error type of the service: a request that cannot be served, with its gRPC status."""

from __future__ import annotations

__all__ = ["ServiceError"]


class ServiceError(Exception):
    """A request that cannot be served; ``code`` names the gRPC status (``NOT_FOUND``...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
