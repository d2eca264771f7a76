"""Every call's request decoded by the service itself, and no Python exception text to clients.

gRPC decodes a request before the handler runs and answers ``INTERNAL`` ("Exception
deserializing request!") when it cannot; an exception a handler did not expect becomes
``UNKNOWN`` with Python's text. :class:`GuardInterceptor` registers each handler to take raw
bytes, decodes them itself (a request that does not decode is ``INVALID_ARGUMENT``), and turns
an unexpected exception into ``INTERNAL`` with a short message, logging the exception through
``on_error``. Installed after the token check, so a caller without the token gets
``UNAUTHENTICATED`` before anything of its request is decoded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
from google.protobuf.message import DecodeError

__all__ = ["KINDS", "GuardInterceptor", "raw_handler"]

INTERNAL_MESSAGE = "internal error (the service's log says why)"
KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
"""The four kinds of gRPC method, by whether requests and replies stream."""


def raw_handler(handler: Any, run: dict[str, Callable[..., Any]]) -> grpc.RpcMethodHandler:
    """A method handler of ``handler``'s kind running ``run[kind]`` on the request as raw bytes
    (nothing of it decoded first), its replies encoded as ``handler`` encodes them."""
    kind = next((k for k in KINDS[:-1] if getattr(handler, k)), KINDS[-1])
    make = getattr(grpc, f"{kind}_rpc_method_handler")
    return make(
        run[kind], request_deserializer=None, response_serializer=handler.response_serializer
    )


def _decode(raw: bytes, deserializer: Any, context: grpc.ServicerContext) -> Any:
    if deserializer is None:
        return raw
    try:
        return deserializer(raw)
    except (DecodeError, ValueError, TypeError):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the request does not decode")


class GuardInterceptor(grpc.ServerInterceptor):
    """Decodes requests itself and hides unexpected exceptions (module docstring).

    Args:
        on_error: told of every unexpected exception (for the log).
    """

    def __init__(self, on_error: Callable[[BaseException], None]) -> None:
        self._on_error = on_error

    def _failed(self, exc: Exception, context: grpc.ServicerContext) -> None:
        if context.code() is not None:  # the handler aborted on purpose: keep its status
            raise exc
        self._on_error(exc)
        context.abort(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)

    def _requests(self, raw: Iterator[bytes], decode: Any, context: Any) -> Iterator[Any]:
        for r in raw:
            yield _decode(r, decode, context)

    def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        decode = handler.request_deserializer
        guard = self

        def unary_unary(raw: bytes, context: Any) -> Any:
            request = _decode(raw, decode, context)
            try:
                return handler.unary_unary(request, context)
            except Exception as exc:
                guard._failed(exc, context)

        def unary_stream(raw: bytes, context: Any) -> Iterator[Any]:
            request = _decode(raw, decode, context)
            try:
                yield from handler.unary_stream(request, context)
            except Exception as exc:
                guard._failed(exc, context)

        def stream_unary(raw: Iterator[bytes], context: Any) -> Any:
            try:
                return handler.stream_unary(guard._requests(raw, decode, context), context)
            except Exception as exc:
                guard._failed(exc, context)

        def stream_stream(raw: Iterator[bytes], context: Any) -> Iterator[Any]:
            try:
                yield from handler.stream_stream(guard._requests(raw, decode, context), context)
            except Exception as exc:
                guard._failed(exc, context)

        return raw_handler(
            handler,
            {
                "unary_unary": unary_unary,
                "unary_stream": unary_stream,
                "stream_unary": stream_unary,
                "stream_stream": stream_stream,
            },
        )
