"""The peers' data connection: fetched blocks over a plain TCP socket beside gRPC.

gRPC copies each chunk of a ``FetchBlocks`` stream several times in user space (new bytes
objects, HTTP/2 framing, Python per chunk). Here only the kernel copies: the owner sends the
runs of a reply straight from its store (``sendmsg`` of up to :data:`IOV_MAX` buffers), the
asker receives straight into the batch slot (``recvmsg_into`` over the targets' contiguous
runs). With TLS on, both ends wrap the socket in :mod:`ssl` (the same certificate, key and CA
as gRPC) and send and receive run by run.

The connection is authorised through gRPC: ``Peers/OpenData`` (token checked, TLS when on)
gives the asker the port of the owner's :class:`DataListener` and a one-time :data:`TICKET`
byte ticket bound to the asking node. On the connection:

- asker -> owner: the ticket, once; then per fetch a 4-byte big-endian length and a serialized
  ``FetchBlocksRequest`` (at most :data:`MAX_REQUEST` bytes);
- owner -> asker: :data:`REPLY` (the status's name length, its message length, the total
  bytes, the number of runs), the status's name (empty: OK) and message (UTF-8), each run's
  size (8 bytes big-endian), then the runs' bytes.

A wrong, used or expired ticket, no whole ticket within the timeout, or a malformed or
oversized request closes the connection with nothing written. A connection serves one fetch
at a time until the asker closes it; the asker closes one that saw any error.
"""

from __future__ import annotations

import contextlib
import hmac
import secrets
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from datastore.service.errors import ServiceError

__all__ = [
    "IOV_MAX",
    "MAX_REQUEST",
    "REPLY",
    "TICKET",
    "BadFrame",
    "DataConnection",
    "DataListener",
    "PeerError",
]

TICKET = 32  # bytes of a ticket
MAX_REQUEST = 16 * 1024 * 1024  # a longer request frame closes the connection
MAX_RUNS = 1 << 22  # a reply announcing more runs is garbage
IOV_MAX = 1024  # buffers per sendmsg / recvmsg_into (Linux's limit)
MAX_UNTICKETED = 128  # connections waiting to present a ticket at once; more are closed
IDLE_S = 600.0  # a connection with no request for this long is closed (the asker stops
# reusing one well before: grpc_peers.REUSE_S)
MAX_MESSAGE = 4096  # bytes of an error message sent back (longer ones are cut)
KEEPALIVE_S = 60  # a silent connection is probed after half of it, dropped after about all
_LENGTH = struct.Struct("!I")
REPLY = struct.Struct("!HHQI")  # status name length, message length, total bytes, runs
Serve = Callable[[bytes, int], Sequence[np.ndarray]]
"""``serve(request, node) -> runs``: a request of node ``node`` answered (1-d uint8 arrays), or
:class:`ServiceError` (sent back), or :class:`BadFrame` (the connection is closed)."""


class BadFrame(ValueError):
    """A request that is not one: the connection is closed, nothing written."""


class PeerError(Exception):
    """The owner's error reply: ``code`` (a gRPC status name) and its message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


# -- bytes in and out ---------------------------------------------------------------------------
def _views(buffers: Sequence[Any]) -> list[memoryview]:
    return [v for v in (memoryview(b).cast("B") for b in buffers) if v.nbytes]


def _advance(views: list[memoryview], i: int, n: int) -> int:
    """``n`` more bytes of ``views`` moved from ``views[i]`` on: the index of the first view
    not done (a view partly done is cut to what is left)."""
    while n:
        if n >= views[i].nbytes:
            n -= views[i].nbytes
            i += 1
        else:
            views[i], n = views[i][n:], 0
    return i


def send_all(sock: socket.socket, buffers: Sequence[Any]) -> None:
    """Send ``buffers`` one after the other: ``sendmsg`` of up to :data:`IOV_MAX` at a time
    (partial sends resumed), or run by run over TLS."""
    views = _views(buffers)
    if isinstance(sock, ssl.SSLSocket):
        for v in views:
            sock.sendall(v)
        return
    i = 0
    while i < len(views):
        i = _advance(views, i, sock.sendmsg(views[i : i + IOV_MAX]))


def recv_all(sock: socket.socket, buffers: Sequence[Any], deadline: float | None = None) -> None:
    """Fill ``buffers`` one after the other: ``recvmsg_into`` up to :data:`IOV_MAX` at a time,
    or ``recv_into`` each over TLS; ``EOFError`` if the peer closes first, ``TimeoutError``
    past ``deadline`` (``time.monotonic()``; default: the socket's timeout per receive)."""
    views = _views(buffers)
    i = 0
    while i < len(views):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("not all in before the deadline")
            sock.settimeout(left)
        if isinstance(sock, ssl.SSLSocket):
            got = sock.recv_into(views[i])
        else:
            got = sock.recvmsg_into(views[i : i + IOV_MAX])[0]
        if not got:
            raise EOFError("the connection closed mid-reply")
        i = _advance(views, i, got)


def recv_bytes(sock: socket.socket, n: int, deadline: float | None = None) -> bytearray:
    """Exactly ``n`` bytes; ``EOFError`` if the peer closes first (``deadline``: as
    :func:`recv_all`)."""
    out = bytearray(n)
    recv_all(sock, [out], deadline)
    return out


def _reply_head(runs: Sequence[np.ndarray], code: str, message: str) -> bytes:
    sizes = [r.nbytes for r in runs]
    name, text = code.encode(), message.encode()[:MAX_MESSAGE]  # (the header's 16 bits)
    head = REPLY.pack(len(name), len(text), sum(sizes), len(sizes))
    return head + name + text + struct.pack(f"!{len(sizes)}Q", *sizes)


def tune(sock: socket.socket) -> None:
    """A data connection's socket options: no Nagle delay, and TCP keepalive, so that a peer
    whose host died without closing is found out within about :data:`KEEPALIVE_S` of
    silence (the owner's thread and descriptor then end)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_S // 2)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_S // 6)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


# -- the owner's side -------------------------------------------------------------------------
class DataListener:
    """A node's data listener: tickets handed out through ``Peers/OpenData``, and a thread per
    accepted connection answering its requests with ``serve`` once its ticket checks out.

    Args:
        host: the host of the service's ``--tcp`` address.
        port: the port to listen on (``0``: any free port; :attr:`port` says which).
        tls: a server context (the service's certificate and key). Default: plaintext.
        timeout_s: how long a ticket stays valid, and a send or a request's frame may take.
            Default: ``60``.

    Raises:
        OSError: the address cannot be bound.
    """

    def __init__(
        self, host: str, port: int = 0, tls: ssl.SSLContext | None = None, timeout_s: float = 60.0
    ) -> None:
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        every = host == "::" and socket.has_dualstack_ipv6()  # IPv4 peers too, as gRPC takes
        self._sock = socket.create_server((host, port), family=family, dualstack_ipv6=every)
        self.port: int = self._sock.getsockname()[1]
        self._tls, self.timeout_s = tls, timeout_s
        self._lock = threading.Lock()
        self._tickets: dict[bytes, tuple[int, float]] = {}  # ticket -> (node, expiry)
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()  # the connections' threads, running
        self._closed = False
        self._unticketed = 0  # connections not past their ticket yet
        self.served = 0  # requests answered (counted before the reply goes out, errors included)

    def ticket(self, node: int) -> bytes:
        """A fresh one-time ticket for node ``node``, valid for ``timeout_s``."""
        ticket, now = secrets.token_bytes(TICKET), time.monotonic()
        with self._lock:
            self._tickets = {t: v for t, v in self._tickets.items() if v[1] > now}
            self._tickets[ticket] = (node, now + self.timeout_s)
        return ticket

    def _redeem(self, ticket: bytes) -> int | None:
        """The node a valid ticket was given to (the ticket is then used up); else ``None``."""
        now, node = time.monotonic(), None
        with self._lock:
            for t in list(self._tickets):  # every one compared: no early exit to time
                if hmac.compare_digest(t, ticket):
                    held, expiry = self._tickets.pop(t)
                    node = held if expiry > now else None
        return node

    def start(self, serve: Serve) -> None:
        """Accept connections on a daemon thread; each is answered by ``serve``."""
        threading.Thread(
            target=self._accept, args=(serve,), name="datastore-data", daemon=True
        ).start()

    def _accept(self, serve: Serve) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                if self._unticketed >= MAX_UNTICKETED:  # a flood: closed unanswered
                    conn.close()
                    continue
                self._unticketed += 1
                self._conns.add(conn)
            thread = threading.Thread(
                target=self._answer, args=(conn, serve), name="datastore-data", daemon=True
            )
            try:
                with self._lock:
                    self._threads.add(thread)
                thread.start()
            except RuntimeError:  # no thread to be had: this one closed, the next tried
                self._ticketed(conn)
                with self._lock:
                    self._conns.discard(conn)
                conn.close()

    def _ticketed(self, conn: socket.socket) -> None:
        """``conn`` is past its ticket (or gone): no longer counted as waiting for one."""
        with self._lock:
            self._unticketed -= 1

    def _answer(self, conn: socket.socket, serve: Serve) -> None:
        sock, deadline, waiting = conn, time.monotonic() + self.timeout_s, True
        try:
            conn.settimeout(self.timeout_s)
            tune(conn)
            if self._tls is not None:
                sock = self._tls.wrap_socket(conn, server_side=True)  # (conn is detached)
                with self._lock:  # close() must shut the socket that now holds the fd
                    self._conns.discard(conn)
                    if self._closed:
                        return
                    self._conns.add(sock)
            # the whole ticket within the timeout: bytes dripped in never hold a thread long
            node = self._redeem(bytes(recv_bytes(sock, TICKET, deadline)))
            waiting = False
            self._ticketed(conn)
            while node is not None:
                sock.settimeout(IDLE_S)  # between fetches: the asker keeps it for the next
                (n,) = _LENGTH.unpack(recv_bytes(sock, _LENGTH.size))
                sock.settimeout(self.timeout_s)
                if n > MAX_REQUEST:
                    return
                request = bytes(recv_bytes(sock, n))
                try:
                    runs, code, message = serve(request, node), "", ""
                except ServiceError as exc:
                    runs, code, message = [], exc.code, str(exc)
                with self._lock:  # (before the send: an asker that has the reply sees it)
                    self.served += 1
                send_all(sock, [_reply_head(runs, code, message), *runs])
        except (OSError, EOFError, BadFrame):
            return  # closed, timed out, or not a peer: nothing more written
        finally:
            if waiting:
                self._ticketed(conn)
            with self._lock:
                self._conns.discard(conn)
                self._conns.discard(sock)
                self._threads.discard(threading.current_thread())
            sock.close()

    def close(self, wait_s: float = 5.0) -> None:
        """Stop listening, end every connection, and wait up to ``wait_s`` for their threads
        (one answering a request finishes it first): none is left answering while the
        process exits."""
        with self._lock:
            self._closed = True
            conns, self._conns = list(self._conns), set()
            threads = list(self._threads)
        for s in [self._sock, *conns]:
            with contextlib.suppress(OSError):  # not connected
                s.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        deadline = time.monotonic() + wait_s
        for t in threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))


# -- the asker's side -------------------------------------------------------------------------
class DataConnection:
    """One data connection to a peer, presenting its ticket; one fetch at a time.

    Raises:
        OSError: the connection cannot be made within ``connect_s`` (refused, unreachable,
            timed out, TLS handshake failed).
    """

    def __init__(
        self,
        address: str,
        ticket: bytes,
        *,
        tls: ssl.SSLContext | None,
        connect_s: float,
        timeout_s: float,
    ) -> None:
        host, port = _split(address)
        raw = socket.create_connection((host, port), timeout=connect_s)
        try:
            tune(raw)
            self.sock = raw if tls is None else tls.wrap_socket(raw, server_hostname=host)
            self.quiet_since = time.monotonic()  # (when it last finished a fetch)
            self.sock.settimeout(timeout_s)
            self.sock.sendall(ticket)
        except BaseException:
            raw.close()
            raise

    def fetch(self, request: bytes, into: Sequence[Any]) -> tuple[list[int], float]:
        """Send ``request``, receive the reply's bytes into ``into`` (writable buffers, filled
        one after the other; their total must be the reply's); ``(run sizes, time of the
        reply's header in)``.

        Raises:
            PeerError: the owner's error, or a reply of another size than ``into``.
            OSError, EOFError: the connection failed, timed out, or closed mid-reply.
        """
        send_all(self.sock, [_LENGTH.pack(len(request)), request])
        code_n, message_n, total, count = REPLY.unpack(recv_bytes(self.sock, REPLY.size))
        first = time.monotonic()
        if count > MAX_RUNS:
            raise PeerError("INTERNAL", f"a reply of {count} runs")
        head = recv_bytes(self.sock, code_n + message_n + 8 * count)
        if code_n:
            raise PeerError(head[:code_n].decode(), head[code_n:][:message_n].decode())
        sizes = list(struct.unpack_from(f"!{count}Q", head, code_n + message_n))
        want = sum(memoryview(b).nbytes for b in into)
        if total != want or sum(sizes) != total:
            raise PeerError("INTERNAL", f"sent {total} bytes where {want} were asked")
        recv_all(self.sock, into)
        return sizes, first

    def idle(self) -> bool:
        """Whether the connection is still quiet (the peer sent nothing, not even its end):
        fit to reuse."""
        if isinstance(self.sock, ssl.SSLSocket) and self.sock.pending():
            return False
        poll = select.poll()  # (select cannot take a descriptor above 1023)
        try:
            poll.register(self.sock, select.POLLIN)
        except (OSError, ValueError):  # closed
            return False
        return not poll.poll(0)

    def stop(self) -> None:
        """Shut the connection down: a send or receive in progress returns at once."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.sock.close()
