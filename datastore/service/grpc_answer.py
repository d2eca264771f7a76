"""The answering side of the gRPC peer link: ``datastore.v1.Peers`` on a service's TCP port.

A peer's ``Describe``, ``FetchBlocks`` and ``JobFailed`` are answered by the servicer's
``answer`` (as over MPI); ``OpenData`` hands out a one-time ticket for this node's data connection
(:mod:`datastore.service.data_link`), whose fetches :meth:`PeersServicer.serve_data` answers.
:mod:`datastore.service.grpc_peers` is the asking side.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from datastore.service._pb.v1 import datastore_pb2 as pb
from datastore.service.data_link import BadFrame, DataListener
from datastore.service.errors import ServiceError
from datastore.service.grpc_peers import CHUNK, DATA_FIELD, SERVICE
from datastore.service.peer_link import Pieces
from datastore.service.wire import bytes_field

__all__ = ["PeersServicer", "add_peers_to_server", "frame_chunk"]


def frame_chunk(chunk: np.ndarray) -> bytes:
    """A ``FetchBlocksResponse`` whose ``data`` is ``chunk``'s bytes."""
    return bytes_field(DATA_FIELD, chunk)


# -- answering ---------------------------------------------------------------------------------
class PeersServicer:
    """``datastore.v1.Peers``: a peer's requests, answered by ``answer`` (the servicer's).

    Args:
        node, nodes: this service's index and the store's size.
        answer: ``answer(request) -> reply`` as :class:`~datastore.service.mpi_peers.MpiPeers`
            takes it (``{"kind": "describe" | "fetch", ...}``).
        spatial_of: a ``SpatialLayout`` as the dict ``answer`` takes.
        on_error: told of an unexpected exception (logged there; the peer gets ``INTERNAL``
            without Python's text). Default: nothing.
        data: this node's data listener, whose tickets ``OpenData`` hands out. Default: none
            (``OpenData`` answers ``UNIMPLEMENTED``: the peers fetch over gRPC).
        at_once: ``at_once(request) -> reply | None``: ``answer``'s reply to a fetch of
            samples in RAM (views: no path resolved, nothing read), ``None`` where it leaves
            the request to ``answer``. Default: every request to ``answer``.
    """

    def __init__(
        self,
        node: int,
        nodes: int,
        answer: Callable[[dict], Any],
        spatial_of: Callable[[Any], dict[str, Any] | None],
        on_error: Callable[[BaseException], None] = lambda exc: None,
        data: DataListener | None = None,
        at_once: Callable[[dict], Any] = lambda request: None,
    ) -> None:
        self.node, self.nodes = node, nodes
        self._answer, self._spatial_of, self._on_error = answer, spatial_of, on_error
        self._data, self._at_once = data, at_once

    def _mismatch(self, header: Any) -> ServiceError | None:
        if (header.to_node, header.nodes) == (self.node, self.nodes):
            return None
        return ServiceError(
            "FAILED_PRECONDITION",
            f"this service is node {self.node} of {self.nodes}, asked as node "
            f"{header.to_node} of {header.nodes}: every service needs the same --peers "
            "and its own --node",
        )

    def _check(self, header: Any, context: grpc.ServicerContext) -> None:
        if (wrong := self._mismatch(header)) is not None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(wrong))

    def _answered(self, request: dict) -> Any:
        try:
            reply = self._at_once(request) if request["kind"] == "fetch" else None
            return self._answer(request) if reply is None else reply
        except ServiceError:
            raise
        except Exception as exc:  # a peer's bad request must not kill this service
            self._on_error(exc)
            raise ServiceError("INTERNAL", "internal error (the service's log says why)") from None

    def _call(self, request: dict, context: grpc.ServicerContext) -> Any:
        try:
            return self._answered(request)
        except ServiceError as exc:
            context.abort(getattr(grpc.StatusCode, exc.code), str(exc))

    def Describe(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._check(request.header, context)
        ok, files, signature = self._call(
            {"kind": "describe", "path": request.dataset_path}, context
        )
        fields = [
            pb.FieldSignature(name=n, dtype=dtype, shape=shape)
            for n, (dtype, shape) in signature.items()
        ]
        return pb.DescribeResponse(shardable=ok, files=files, fields=fields)

    def JobFailed(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._check(request.header, context)
        ended = self._call({"kind": "job_failed", "job": request.job, "why": request.why}, context)
        return pb.JobFailedResponse(streams=ended)

    def _fetched(self, request: Any) -> list[np.ndarray]:
        """A ``FetchBlocksRequest`` answered: the reply's bytes as 1-d uint8 runs."""
        reply = self._answered(
            {
                "kind": "fetch",
                "path": request.dataset_path,
                "samples": [int(i) for i in request.samples],
                "fields": list(request.fields),
                "spatial": self._spatial_of(request.spatial),
                "block": request.block,
                "pieces": request.pieces,
                "index": request.index,
            }
        )
        if isinstance(reply, Pieces):  # straight from the store: nothing packed
            return reply.runs()
        return [np.ascontiguousarray(reply).reshape(-1).view(np.uint8)]

    def FetchBlocks(self, request: Any, context: grpc.ServicerContext) -> Iterator[np.ndarray]:
        self._check(request.header, context)
        try:
            cut = self._fetched(request)
        except ServiceError as exc:
            context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
        for run in cut:
            for at in range(0, run.nbytes, CHUNK):
                yield run[at : at + CHUNK]

    def OpenData(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._check(request.header, context)
        if self._data is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this service has no data listener")
        ticket = self._data.ticket(request.header.from_node)
        return pb.OpenDataResponse(port=self._data.port, ticket=ticket)

    def serve_data(self, raw: bytes, node: int) -> list[np.ndarray]:
        """A ``FetchBlocksRequest`` of node ``node`` on its data connection, answered.

        Raises:
            BadFrame: ``raw`` is not a request.
            ServiceError: as ``FetchBlocks`` fails.
        """
        try:
            request = pb.FetchBlocksRequest.FromString(raw)
        except DecodeError:
            raise BadFrame("not a FetchBlocksRequest") from None
        if request.header.from_node != node:
            raise BadFrame(f"node {node}'s ticket, asked as node {request.header.from_node}")
        if (wrong := self._mismatch(request.header)) is not None:
            raise wrong
        return self._fetched(request)


def add_peers_to_server(servicer: PeersServicer, server: grpc.Server) -> None:
    """Register ``datastore.v1.Peers``; ``FetchBlocks`` chunks are framed by hand."""
    handlers = {
        "Describe": grpc.unary_unary_rpc_method_handler(
            servicer.Describe,
            request_deserializer=pb.DescribeRequest.FromString,
            response_serializer=pb.DescribeResponse.SerializeToString,
        ),
        "FetchBlocks": grpc.unary_stream_rpc_method_handler(
            servicer.FetchBlocks,
            request_deserializer=pb.FetchBlocksRequest.FromString,
            response_serializer=frame_chunk,
        ),
        "OpenData": grpc.unary_unary_rpc_method_handler(
            servicer.OpenData,
            request_deserializer=pb.OpenDataRequest.FromString,
            response_serializer=pb.OpenDataResponse.SerializeToString,
        ),
        "JobFailed": grpc.unary_unary_rpc_method_handler(
            servicer.JobFailed,
            request_deserializer=pb.JobFailedRequest.FromString,
            response_serializer=pb.JobFailedResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
