"""The calls a service received and the clients it has now, for ``Status``.

A client, as ``StatusResponse.clients`` counts them, is an open session (one job, however many
of its ranks stream) or a ``DataStore`` call in flight that stands for a caller of its own: a
``LoadDataset --wait``, a ``Stage``, an ``OpenSession`` still opening. A session's own calls
(``StreamBatches``, ``CloseSession``) are its session's, and the ``Status`` call is the one
asking; health checks, reflection and the peers' calls are not clients.
"""

from __future__ import annotations

import threading
from typing import Any

import grpc

from datastore.service import SERVICE_NAME

__all__ = ["CallCounter", "Refusing"]

NOT_CLIENTS = ("StreamBatches", "CloseSession", "Status")
"""``DataStore`` calls that stand for no client of their own (see the module docstring)."""

_HANDLERS = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


def stands_for_a_client(method: str) -> bool:
    """Whether a call of ``method`` (``/package.Service/Method``) counts as a client."""
    service, _, name = method.lstrip("/").partition("/")
    return service == SERVICE_NAME and name not in NOT_CLIENTS


class CallCounter(grpc.ServerInterceptor):
    """Counts every call received (``served``) and the calls in flight that stand for a client
    (``in_flight``); one instance serves every listener of a service."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._served = 0
        self._in_flight = 0

    @property
    def served(self) -> int:
        with self._lock:
            return self._served

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def _begin(self, context: grpc.ServicerContext) -> None:
        with self._lock:
            self._in_flight += 1
        if not context.add_callback(self._end):  # the call has already ended
            self._end()

    def _end(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        with self._lock:
            self._served += 1
        handler = continuation(handler_call_details)
        if handler is None or not stands_for_a_client(handler_call_details.method):
            return handler
        begin = self._begin

        def wrap(behaviour: Any) -> Any:
            def call(request: Any, context: grpc.ServicerContext) -> Any:
                begin(context)  # ends with the call, however it ends (add_callback)
                return behaviour(request, context)

            return call

        kind = next(k for k in _HANDLERS if getattr(handler, k) is not None)
        return _HANDLERS[kind](
            wrap(getattr(handler, kind)),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


class Refusing(grpc.ServerInterceptor):
    """Once ``stopping()`` says so, new ``datastore.v1.DataStore`` calls but ``STILL_ANSWERED``
    are ``UNAVAILABLE`` ("the service is stopping"): the service stops taking work itself
    while the calls in flight drain, as gRPC's own stop would, without its GOAWAY (see
    ``server._drain``)."""

    STILL_ANSWERED = ("CloseSession", "Status", "Shutdown")

    def __init__(self, stopping: Any) -> None:
        self._stopping = stopping

    def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        service, _, name = handler_call_details.method.lstrip("/").partition("/")
        if handler is None or service != SERVICE_NAME or name in self.STILL_ANSWERED:
            return handler
        if not self._stopping():
            return handler

        def refuse(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the service is stopping")

        kind = next(k for k in _HANDLERS if getattr(handler, k) is not None)
        return _HANDLERS[kind](
            refuse,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
