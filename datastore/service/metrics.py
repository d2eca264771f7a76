"""Prometheus metrics of ``datastore serve``, read from its ``Status`` reply at scrape time.

Nothing is counted twice: the collector reads what ``datastore status`` shows when Prometheus
scrapes ``http://HOST:PORT/metrics``. Per-job series carry ``job`` (the session's
``job_id``, or its session id) and ``session`` labels and disappear with their session.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, generate_latest, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer

__all__ = ["ServiceCollector", "metrics_app", "render", "serve_metrics"]

PATH = "/metrics"


class ServiceCollector:
    """Collects from ``state()``, a ``datastore.v1.StatusResponse`` (the ``Status`` reply)."""

    def __init__(self, state: Callable[[], Any]) -> None:
        self._state = state

    def collect(self) -> Iterator[Any]:
        s = self._state()
        for name, doc, value in (
            ("datastore_batches_served", "Batches streamed to trainers.", s.batches_served),
            ("datastore_bytes_served", "Tensor bytes streamed to trainers.", s.bytes_served),
            ("datastore_calls", "gRPC calls received.", s.calls_served),
            ("datastore_exchange_bytes", "Bytes received from peer services.", s.bytes_exchanged),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        for name, doc, value in (
            ("datastore_resident_bytes", "Bytes of datasets in memory.", s.bytes_resident),
            (
                "datastore_memory_budget_bytes",
                "Memory budget for datasets (0: none).",
                s.memory_budget,
            ),
            ("datastore_streams", "Batch streams open now.", sum(x.streams for x in s.sessions)),
            ("datastore_clients", "Open sessions and calls in flight of other clients.", s.clients),
        ):
            yield GaugeMetricFamily(name, doc, value=value)

        labels = ["job", "session"]
        batches = CounterMetricFamily(
            "datastore_job_batches_served", "Batches streamed to a job.", labels=labels
        )
        nbytes = CounterMetricFamily(
            "datastore_job_bytes_served", "Tensor bytes streamed to a job.", labels=labels
        )
        stall = CounterMetricFamily(
            "datastore_job_stall_seconds",
            "Time a job's streams waited for batches to be prepared.",
            labels=labels,
        )
        for x in s.sessions:
            key = [x.job_id or x.session_id, x.session_id]
            batches.add_metric(key, x.batches_served)
            nbytes.add_metric(key, x.bytes_served)
            stall.add_metric(key, x.stall_s)
        yield from (batches, nbytes, stall)

        ds = ["dataset"]
        resident = GaugeMetricFamily(
            "datastore_dataset_resident_bytes", "Bytes of a dataset in memory.", labels=ds
        )
        hits = CounterMetricFamily(
            "datastore_dataset_hits", "Sample reads served from memory.", labels=ds
        )
        misses = CounterMetricFamily(
            "datastore_dataset_misses", "Sample reads that went to the disk.", labels=ds
        )
        ratio = GaugeMetricFamily(
            "datastore_dataset_hit_ratio", "hits / (hits + misses) so far.", labels=ds
        )
        for d in s.datasets:
            resident.add_metric([d.path], d.bytes_resident)
            hits.add_metric([d.path], d.hits)
            misses.add_metric([d.path], d.misses)
            total = d.hits + d.misses
            ratio.add_metric([d.path], d.hits / total if total else 0.0)
        yield from (resident, hits, misses, ratio)


def _registry(state: Callable[[], Any]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServiceCollector(state))
    return registry


def render(state: Callable[[], Any]) -> bytes:
    """The metrics in Prometheus' text format."""
    return generate_latest(_registry(state))


def metrics_app(app: Callable[..., Iterable[bytes]]) -> Callable[..., list[bytes]]:
    """``app`` (prometheus_client's, which answers every path) on ``/metrics`` only.

    GET gets the metrics, HEAD their headers; any other path is 404, any other method 405."""

    def serve(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        method = environ["REQUEST_METHOD"]
        if environ.get("PATH_INFO") != PATH:
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [f"not found: the metrics are on {PATH}\n".encode()]
        if method not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD")])
            return [b""]
        answer: list[Any] = []
        body = b"".join(app({**environ, "REQUEST_METHOD": "GET"}, lambda *a: answer.extend(a)))
        status, headers = answer[:2]
        start_response(status, [*headers, ("Content-Length", str(len(body)))])
        return [b""] if method == "HEAD" else [body]

    return serve


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Log nothing (the service's log is JSON lines)."""


def serve_metrics(address: str, state: Callable[[], Any]) -> tuple[Any, int]:
    """Serve ``/metrics`` on ``HOST:PORT`` (port 0: any free one); ``(server, port)``.

    ``server.shutdown()`` stops it."""
    host, _, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]") or "127.0.0.1"  # [::1]: as --tcp takes it
    family = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)

    class Server(ThreadingWSGIServer):
        address_family = family[0][0]

    app = metrics_app(make_wsgi_app(_registry(state)))
    server = make_server(host, int(port), app, Server, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="datastore-metrics", daemon=True).start()
    return server, server.server_address[1]
