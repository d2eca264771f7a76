"""What ``datastore serve`` was asked for: :class:`ServeConfig`, checked as it is made."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MAX_GRACE_S", "ServeConfig"]

MAX_GRACE_S = 3600.0
"""The longest drain ``--grace`` or ``Shutdown(grace_s)`` may ask for."""
MAX_PEER_TIMEOUT_S = 86400.0
"""The longest ``--peer-timeout`` (a gRPC deadline 1e10 s ahead overflowed: every call failed)."""


@dataclass(frozen=True)
class ServeConfig:
    """What ``datastore serve`` was asked for.

    Args:
        socket: the Unix socket path.
        private: ``socket`` is the default path, whose directory must be private.
        tcp: ``HOST:PORT`` to listen on as well (port 0: any free port). Default: none.
        token_file: the shared secret for ``tcp``; required with it. Default: none.
        tls_cert, tls_key: PEM certificate chain and private key: TCP is served over TLS.
            Default: none (plaintext TCP, the token in the clear: trusted networks only).
        grace_s: seconds to let calls in flight finish on shutdown. Default: ``5.0``.
        workers: threads serving calls, one per call in flight (a stream holds one for its
            life; a call beyond them is ``RESOURCE_EXHAUSTED``). Default: ``128``.
        memory_budget: bytes of memory for resident datasets. Default: none (no limit).
        state_file: where the resident datasets are listed, to reload them after a restart.
            Default: none.
        allowed_roots: datasets (and stage paths) must lie under one of these. Default: any.
        session_idle_s: close a session that has had no stream for this long. Default: ``600``.
        metrics: ``HOST:PORT`` to serve Prometheus ``/metrics`` on. Default: none.
        peers: every service's TCP ``HOST:PORT`` when the services of a store peer over gRPC
            (:mod:`datastore.service.grpc_peers`), in node order. Default: none.
        node: this service's index in ``peers``. Default: none.
        peer_ca: PEM certificate(s) to check the peers' TLS against. Default: ``tls_cert``.
        peer_timeout_s: how long a request to a peer may wait. Default: ``60``.
        data_port: the TCP port of the peers' data connections, on the host of ``tcp``
            (:mod:`datastore.service.data_link`; 0: any free port). Default: ``0``.
    """

    socket: Path
    private: bool = False
    tcp: str | None = None
    token_file: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    grace_s: float = 5.0
    workers: int = 128
    memory_budget: int | None = None
    state_file: Path | None = None
    allowed_roots: tuple[Path, ...] = ()
    session_idle_s: float = 600.0
    metrics: str | None = None
    peers: tuple[str, ...] = ()
    node: int | None = None
    peer_ca: Path | None = None
    peer_timeout_s: float = 60.0
    data_port: int = 0

    def __post_init__(self) -> None:
        if self.tcp is not None and self.token_file is None:
            raise ValueError("--tcp needs --token-file: TCP is never served without a secret")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_cert is not None and self.tcp is None:
            raise ValueError("--tls-cert is for --tcp (the Unix socket needs no TLS)")
        if self.tcp is not None:
            _check_host_port("--tcp", self.tcp)
        if not (math.isfinite(self.grace_s) and 0 <= self.grace_s <= MAX_GRACE_S):
            raise ValueError(f"--grace must be 0..{MAX_GRACE_S:g} seconds, got {self.grace_s}")
        if self.workers < 1:
            raise ValueError("--workers must be >= 1")
        if self.memory_budget is not None and self.memory_budget <= 0:  # (0: an empty variable)
            raise ValueError(
                f"--memory-budget must be more than 0 bytes, got {self.memory_budget} (leave it "
                "out for no limit)"
            )
        _check_seconds("--session-idle", self.session_idle_s)
        if self.metrics is not None:
            _check_host_port("--metrics", self.metrics)
        if self.peers and (self.tcp is None or self.node is None):
            raise ValueError("--peers needs --tcp (peers call each other there) and --node")
        if self.node is not None and not self.peers:
            raise ValueError("--node goes with --peers")
        if self.node is not None and not 0 <= self.node < len(self.peers):
            raise ValueError(f"--node {self.node} is not an index of the {len(self.peers)} --peers")
        if self.peers and self.tcp is not None and self.node is not None:
            port, called = self.tcp.rpartition(":")[2], self.peers[self.node].rpartition(":")[2]
            if port not in ("0", called):  # (0: any free port, which the peers cannot know)
                raise ValueError(
                    f"--tcp {self.tcp} is not on the port of --peers entry {self.node} "
                    f"({self.peers[self.node]}), where the other services call node {self.node}"
                )
        if self.peer_ca is not None and self.tls_cert is None:
            raise ValueError("--peer-ca is for TLS (--tls-cert)")
        if not 0 <= self.data_port < 65536:
            raise ValueError(f"--data-port must be 0..65535, got {self.data_port}")
        if self.data_port and not self.peers:
            raise ValueError("--data-port goes with --peers")
        clash = _shared_port(self.tcp, self.data_port, self.metrics)
        if clash:
            raise ValueError(f"{clash}: give each its own")
        _check_seconds("--peer-timeout", self.peer_timeout_s)
        if self.peer_timeout_s > MAX_PEER_TIMEOUT_S:
            raise ValueError(
                f"--peer-timeout must be at most {MAX_PEER_TIMEOUT_S:g} seconds (a day), got "
                f"{self.peer_timeout_s:g}"
            )
        for r in self.allowed_roots:
            if not os.path.exists(r):
                raise ValueError(f"--allow {r}: no such directory")
        roots = tuple(Path(os.path.realpath(r)) for r in self.allowed_roots)
        object.__setattr__(self, "allowed_roots", roots)
        state = self.state_file
        if state is not None and state.is_dir():
            raise ValueError(f"--state-file {state} is a directory: name a file in one")
        if state is not None and state.parent.exists() and not state.parent.is_dir():
            raise ValueError(f"--state-file {state}: {state.parent} is not a directory")


def _check_seconds(option: str, seconds: float) -> None:
    """A duration that is finite and more than 0 (``nan`` passed ``<= 0``: sessions never
    expired, and a request to a peer never timed out)."""
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{option} must be a finite number of seconds > 0, got {seconds}")


_ANY_HOST = ("", "0.0.0.0", "::", "[::]")


def _shared_port(tcp: str | None, data_port: int, metrics: str | None) -> str | None:
    """Which two listeners the arguments put on one port, or ``None`` (the second to bind
    stopped the start with exit 1, "Address already in use"). The data port listens on the
    host of ``tcp``."""
    listens = []  # (option, as given, the HOST:PORT it listens on)
    if tcp is not None:
        listens.append(("--tcp", tcp, tcp))
        if data_port:
            listens.append(("--data-port", str(data_port), f"{tcp.rpartition(':')[0]}:{data_port}"))
    if metrics is not None:
        listens.append(("--metrics", metrics, metrics))
    for i, (first, given, address) in enumerate(listens):
        for option, value, other in listens[i + 1 :]:
            if _same_port(address, other):
                return f"{option} {value} is the port of {first} {given}"
    return None


def _same_port(a: str, b: str) -> bool:
    """Whether ``HOST:PORT`` ``a`` and ``b`` are one port (not 0: any free port) on one host
    or on any address."""
    (host, _, port), (other, _, same) = a.rpartition(":"), b.rpartition(":")
    hosts = host == other or host in _ANY_HOST or other in _ANY_HOST
    return int(port) != 0 and int(port) == int(same) and hosts


def _check_host_port(option: str, address: str) -> None:
    """``HOST:PORT`` with a port of 0..65535 (gRPC took 99999 as 34463, its value mod 65536,
    and listened there; ``--metrics`` stopped with an internal error)."""
    port = address.rpartition(":")[2]
    if ":" not in address or not (port.isascii() and port.isdigit()):
        raise ValueError(f"{option} wants HOST:PORT, got {address!r}")
    if int(port) > 65535:
        raise ValueError(f"{option}: the port must be 0..65535, got {address!r}")
