"""The shared secret of a TCP listener: read from a file, checked on every call.

Clients send ``authorization: Bearer <token>`` metadata; a call without it or with another
token ends at once with ``UNAUTHENTICATED``, before any handler runs (health checking and
reflection included).
"""

from __future__ import annotations

import hmac
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from datastore.service.guard import KINDS, raw_handler

__all__ = ["METADATA_KEY", "TokenInterceptor", "bearer", "read_token"]

METADATA_KEY = "authorization"


def read_token(path: Path | str) -> tuple[str, bool]:
    """The token in ``path`` (stripped) and whether the file is readable by others.

    Raises:
        ValueError: the file is empty.
        OSError: it cannot be read.
    """
    p = Path(path)
    token = p.read_text(encoding="utf-8").strip()
    if not token:
        raise ValueError(f"token file {p} is empty")
    loose = bool(stat.S_IMODE(os.stat(p).st_mode) & 0o077)
    return token, loose


def bearer(token: str) -> tuple[tuple[str, str]]:
    """The call metadata that carries ``token``."""
    return ((METADATA_KEY, f"Bearer {token}"),)


def _deny(message: str) -> Callable[[Any, grpc.ServicerContext], Any]:
    def deny(_request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return deny


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call whose ``authorization`` metadata is not ``Bearer <token>``.

    Args:
        token: the shared secret.
        on_denied: called with the method name of every refused call (for the log).
    """

    def __init__(self, token: str, on_denied: Callable[[str], None] | None = None) -> None:
        self._expected = f"Bearer {token}".encode()
        self._on_denied = on_denied

    def intercept_service(self, continuation, handler_call_details):
        got = dict(handler_call_details.invocation_metadata or ()).get(METADATA_KEY)
        if got is not None and hmac.compare_digest(str(got).encode(), self._expected):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:  # unknown method: gRPC answers UNIMPLEMENTED itself
            return None
        if self._on_denied is not None:
            self._on_denied(handler_call_details.method)
        why = "missing token" if got is None else "wrong token"
        deny = _deny(f"{why}: send metadata 'authorization: Bearer <token>'")
        # The request stays raw bytes: nothing a caller without the token sends is decoded.
        return raw_handler(handler, dict.fromkeys(KINDS, deny))
