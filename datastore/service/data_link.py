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

import collections
import contextlib
import hmac
import math
import secrets
import select
import selectors
import socket
import ssl
import struct
import sys
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
    "split_address",
]

TICKET = 32  # bytes of a ticket
MAX_REQUEST = 16 * 1024 * 1024  # a longer request frame closes the connection
MAX_RUNS = 1 << 22  # a reply announcing more runs is garbage
IOV_MAX = 1024  # buffers per sendmsg / recvmsg_into (Linux's limit)
MAX_UNTICKETED = 128  # connections waiting to present a ticket at once; more are closed
IDLE_S = 600.0  # a connection with no request for this long is closed (the asker stops
# reusing one well before: grpc_peers.REUSE_S)
WORKERS = 8  # threads answering requests, however many connections are open
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


def kernel_timeouts(sock: socket.socket, timeout_s: float) -> None:
    """Make the plain socket ``sock`` blocking, a send or receive that moves nothing for
    ``timeout_s`` failing in the kernel (``SO_SNDTIMEO``/``SO_RCVTIMEO``): a reply then moves
    in one ``sendmsg`` and one ``recvmsg_into`` (``MSG_WAITALL``), each releasing the GIL
    once, where a socket with a Python timeout polls and takes the GIL back per segment (64
    calls an 8 MiB reply on loopback)."""
    whole = int(timeout_s)
    tv = struct.pack("ll", whole, int((timeout_s - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    sock.settimeout(None)


def send_all(sock: socket.socket, buffers: Sequence[Any]) -> None:
    """Send ``buffers`` one after the other: ``sendmsg`` of up to :data:`IOV_MAX` at a time
    (partial sends resumed), or run by run over TLS; ``TimeoutError`` where the peer takes
    nothing within the socket's timeout."""
    views = _views(buffers)
    if isinstance(sock, ssl.SSLSocket):
        for v in views:
            sock.sendall(v)
        return
    i = 0
    while i < len(views):
        try:
            i = _advance(views, i, sock.sendmsg(views[i : i + IOV_MAX]))
        except BlockingIOError as exc:  # (SO_SNDTIMEO ran out: kernel_timeouts)
            raise TimeoutError("the peer took nothing within the timeout") from exc


def recv_all(sock: socket.socket, buffers: Sequence[Any]) -> None:
    """Fill ``buffers`` one after the other: ``recvmsg_into`` up to :data:`IOV_MAX` at a time
    (on a blocking socket, waiting for all of them), or ``recv_into`` each over TLS;
    ``EOFError`` if the peer closes first, ``TimeoutError`` where nothing comes within the
    socket's timeout."""
    views = _views(buffers)
    wait_all = socket.MSG_WAITALL if sock.gettimeout() is None else 0
    i = 0
    while i < len(views):
        if isinstance(sock, ssl.SSLSocket):
            got = sock.recv_into(views[i])
        else:
            try:
                got = sock.recvmsg_into(views[i : i + IOV_MAX], 0, wait_all)[0]
            except BlockingIOError as exc:  # (SO_RCVTIMEO ran out: kernel_timeouts)
                raise TimeoutError("nothing came within the timeout") from exc
        if not got:
            raise EOFError("the connection closed mid-reply")
        i = _advance(views, i, got)


def shut_down(sock: socket.socket) -> None:
    """``sock`` shut both ways (if still connected), so that a send or receive in progress in
    another thread returns at once with an error. By ``socket``'s own ``shutdown``:
    ``SSLSocket``'s also drops the TLS state that thread is using, which then reads the
    ciphertext still queued as if it were plaintext, or fails with ``AttributeError``."""
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


def recv_bytes(sock: socket.socket, n: int) -> bytearray:
    """Exactly ``n`` bytes; ``EOFError`` if the peer closes first."""
    out = bytearray(n)
    recv_all(sock, [out])
    return out


def _reply_head(runs: Sequence[np.ndarray], code: str, message: str) -> bytes:
    sizes = [r.nbytes for r in runs]
    name, text = code.encode(), message.encode()[:MAX_MESSAGE]  # (the header's 16 bits)
    head = REPLY.pack(len(name), len(text), sum(sizes), len(sizes))
    return head + name + text + struct.pack(f"!{len(sizes)}Q", *sizes)


def tune(sock: socket.socket) -> None:
    """A data connection's socket options: no Nagle delay, and TCP keepalive, so that a peer
    whose host died without closing is found out within about :data:`KEEPALIVE_S` of
    silence (the owner's descriptor then ends)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_S // 2)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_S // 6)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT``) as ``(host, port)``."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


# -- the owner's side -------------------------------------------------------------------------
class _Conn:
    """An accepted connection and the frame it is sending: its ticket, then per fetch a
    request's length and the request (read without blocking as the bytes come)."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.deadline = sock, deadline  # closed past it (the ticket's, then next)
        self.shaking = isinstance(sock, ssl.SSLSocket)  # its TLS handshake still to finish
        self.node: int | None = None  # the ticket's node, once redeemed
        self.framed = False  # the length read: now the request
        self.buf, self.got = bytearray(TICKET), 0

    def expect(self, n: int) -> None:
        self.buf, self.got = bytearray(n), 0

    def fill(self) -> bool:
        """Read what has come in: whether :attr:`buf` is full.

        Raises:
            EOFError: the peer closed. OSError: the connection failed.
        """
        while self.got < len(self.buf):
            try:
                n = self.sock.recv_into(memoryview(self.buf)[self.got :])
            except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return False
            if not n:
                raise EOFError("the connection closed")
            self.got += n
        return True


class DataListener:
    """A node's data listener: tickets handed out through ``Peers/OpenData``, and the
    connections presenting one answered with ``serve``.

    :data:`WORKERS` + 1 threads (``datastore-data``) take turns (leader/follower): the one
    leading accepts the connections and watches every one waiting for its TLS handshake, its
    ticket or its next request, reading them without blocking; once it has read a whole
    request it lets the next thread lead, answers the request itself (no hand-off between the
    request and its reply) and hands the connection back to be watched. An idle connection
    costs a descriptor, not a thread, and bytes dripped in hold no thread.

    Args:
        host: the host of the service's ``--tcp`` address.
        port: the port to listen on (``0``: any free port; :attr:`port` says which).
        tls: a server context (the service's certificate and key). Default: plaintext.
        timeout_s: how long a ticket stays valid, the TLS handshake and the ticket may take
            together, and a reply's send or a request's frame may take. Default: ``60``.

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
        self._sock.setblocking(False)
        self.port: int = self._sock.getsockname()[1]
        self._tls, self.timeout_s = tls, timeout_s
        self._lock = threading.Lock()
        self._tickets: dict[bytes, tuple[int, float]] = {}  # ticket -> (node, expiry)
        self._conns: set[socket.socket] = set()  # open: watched, or being answered
        self._lead = threading.Lock()  # held by the thread watching (the others wait on it)
        self._sel: selectors.BaseSelector | None = None  # (made by start)
        self._whole: collections.deque[_Conn] = collections.deque()  # read, to be answered
        self._paused = math.inf  # accepting paused until (out of descriptors)
        self._ended = False  # (the leader that saw the close) connections closed
        self._answering = 0  # threads answering a request (at most WORKERS)
        self._back: list[_Conn] = []  # answered: to watch again
        self._wake, self._waker = socket.socketpair()  # (a byte: look at _back, or _closed)
        self._wake.setblocking(False)
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._due = math.inf  # the leader's next look at the deadlines (none sooner)
        self._unticketed = 0  # connections not past their ticket yet (the leaders' count)
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
        """Accept, watch and answer connections on :data:`WORKERS` + 1 daemon threads: one
        watches (the leader) while the others wait their turn; the one that reads a whole
        request lets the next one watch and answers it itself (no hand-off before the reply).

        A listener closed already (a service stopping before it started) starts nothing.

        Raises:
            ServiceError: ``FAILED_PRECONDITION``, it was started already.
        """
        threads = [
            threading.Thread(target=self._work, args=(serve,), name="datastore-data", daemon=True)
            for _ in range(WORKERS + 1)
        ]
        with self._lock:  # started within it: a close sees them all started, or none
            if self._closed:  # (its sockets closed already)
                return
            if self._threads:
                raise ServiceError(
                    "FAILED_PRECONDITION", f"the data listener on port {self.port} runs already"
                )
            sel = selectors.DefaultSelector()
            sel.register(self._wake, selectors.EVENT_READ)
            sel.register(self._sock, selectors.EVENT_READ)
            self._sel, self._threads = sel, threads
            for t in threads:
                t.start()

    # -- the leader: accepting, handshakes, tickets and request frames, never blocking --------
    def _next(self) -> _Conn | None:
        """(The leader) the next connection whose request is whole, once a thread is left to
        lead after this one (at most :data:`WORKERS` answer at once: one always watches, so
        tickets and handshakes go on while askers that stop reading hold the others);
        ``None``: closed."""
        sel = self._sel
        assert sel is not None
        while not self._ended:
            if self._whole and self._may_answer():
                return self._whole.popleft()
            wait = self._due - time.monotonic()
            events = sel.select(None if wait == math.inf else max(wait, 0.0))
            if any(key.fileobj is self._wake for key, _ in events):
                with contextlib.suppress(BlockingIOError):  # the wake-ups so far, then
                    self._wake.recv(4096)  # what they were for: one later wakes anew
            with self._lock:
                closed = self._closed
                back, self._back = self._back, []
            if closed:
                self._end(sel, back)
                return None
            now = time.monotonic()
            for key, _ in events:
                if key.fileobj is self._wake:
                    continue
                if key.fileobj is not self._sock:
                    self._advance(sel, key.data)
                elif not self._accept(sel, now):
                    sel.unregister(self._sock)
                    self._paused = now + 1.0
                    self._due = min(self._due, self._paused)
            for c in back:
                sel.register(c.sock, selectors.EVENT_READ, c)
                self._due = min(self._due, c.deadline)
                if isinstance(c.sock, ssl.SSLSocket) and c.sock.pending():
                    self._advance(sel, c)  # decrypted already: its fd may not be ready
            if now >= self._paused:
                sel.register(self._sock, selectors.EVENT_READ)
                self._paused = math.inf
            if now >= self._due:
                self._due = min(self._paused, self._expire(sel, now))
        return None

    def _may_answer(self) -> bool:
        """Whether the leader may answer a request (one more thread answering)."""
        with self._lock:
            if self._answering >= WORKERS:
                return False
            self._answering += 1
            return True

    def _end(self, sel: selectors.BaseSelector, back: list[_Conn]) -> None:
        """(The leader that saw the close) every connection watched, handed ``back`` or read
        closed."""
        self._ended = True
        watched = [k.data for k in sel.get_map().values() if isinstance(k.data, _Conn)]
        for c in watched + back + list(self._whole):
            self._drop(c)
        self._whole.clear()
        sel.close()
        self._sock.close()

    def _accept(self, sel: selectors.BaseSelector, now: float) -> bool:
        """Take the connections waiting to be accepted; ``False``: none can be (out of
        descriptors, or the listener shut)."""
        while True:
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return True
            except OSError:
                return False
            if self._unticketed >= MAX_UNTICKETED:  # a flood: closed unanswered
                conn.close()
                continue
            try:
                conn.setblocking(False)
                tune(conn)
                sock = conn
                if self._tls is not None:  # (conn is detached; handshaken as bytes come)
                    sock = self._tls.wrap_socket(
                        conn, server_side=True, do_handshake_on_connect=False
                    )
            except OSError:  # (gone already)
                conn.close()
                continue
            c = _Conn(sock, now + self.timeout_s)
            with self._lock:
                self._conns.add(sock)
            self._unticketed += 1
            sel.register(sock, selectors.EVENT_READ, c)
            self._due = min(self._due, c.deadline)

    def _advance(self, sel: selectors.BaseSelector, c: _Conn) -> None:
        """``c`` moved on with what it sent: its handshake, ticket and request frame read as
        far as they came; a whole request queued for a thread to answer."""
        try:
            if c.shaking and not self._shaken(sel, c):
                return
            while True:
                quiet = c.framed is False and c.node is not None and not c.got
                full = c.fill()
                if quiet and c.got:  # a request's first bytes: the frame within the timeout
                    c.deadline = time.monotonic() + self.timeout_s
                    self._due = min(self._due, c.deadline)
                if not full:
                    return
                if c.node is None:
                    c.node = self._redeem(bytes(c.buf))
                    if c.node is None:
                        raise BadFrame("not a ticket given out, or used, or expired")
                    self._unticketed -= 1
                    c.expect(_LENGTH.size)
                    c.deadline = time.monotonic() + IDLE_S
                    self._due = min(self._due, c.deadline)
                elif not c.framed:
                    (n,) = _LENGTH.unpack(c.buf)
                    if n > MAX_REQUEST:
                        raise BadFrame(f"a request of {n} bytes")
                    c.expect(n)
                    c.framed = True
                else:
                    sel.unregister(c.sock)
                    self._whole.append(c)
                    return
        except (OSError, EOFError, BadFrame):  # closed, or not a peer: nothing written
            sel.unregister(c.sock)
            self._drop(c)

    def _shaken(self, sel: selectors.BaseSelector, c: _Conn) -> bool:
        """Whether ``c``'s TLS handshake is over (else it waits for the bytes it needs)."""
        try:
            c.sock.do_handshake()  # type: ignore[attr-defined]
        except ssl.SSLWantReadError:
            sel.modify(c.sock, selectors.EVENT_READ, c)
            return False
        except ssl.SSLWantWriteError:
            sel.modify(c.sock, selectors.EVENT_WRITE, c)
            return False
        c.shaking = False
        sel.modify(c.sock, selectors.EVENT_READ, c)
        return True

    def _expire(self, sel: selectors.BaseSelector, now: float) -> float:
        """The watched connections past their deadline closed; the next deadline."""
        due = math.inf
        for key in list(sel.get_map().values()):
            c = key.data
            if not isinstance(c, _Conn):
                continue
            if c.deadline <= now:
                sel.unregister(c.sock)
                self._drop(c)
            else:
                due = min(due, c.deadline)
        return due

    def _drop(self, c: _Conn) -> None:
        """``c`` closed (no longer watched)."""
        with self._lock:
            self._conns.discard(c.sock)
        if c.node is None:
            self._unticketed -= 1
        c.sock.close()

    # -- each thread: watch in turn, answer what it read, hand the connection back -------------
    def _work(self, serve: Serve) -> None:
        while True:
            with self._lead:
                c = self._next()
            if c is None:
                return
            try:
                self._answer(c, serve)
            except Exception:  # a bug, not the peer's: told as a thread's uncaught exception
                threading.excepthook(
                    threading.ExceptHookArgs((*sys.exc_info(), threading.current_thread()))
                )
            finally:
                with self._lock:
                    self._answering -= 1
                if self._whole:  # requests read, waiting for a thread: the leader hands one
                    with contextlib.suppress(OSError):
                        self._waker.send(b"\0", socket.MSG_DONTWAIT)

    def _answer(self, c: _Conn, serve: Serve) -> None:
        kept = False
        try:
            with self._lock:
                if self._closed:
                    return
            assert c.node is not None  # (ticketed before its request was read)
            try:
                runs, code, message = serve(bytes(c.buf), c.node), "", ""
            except ServiceError as exc:
                runs, code, message = [], exc.code, str(exc)
            with self._lock:  # (before the send: an asker that has the reply sees it)
                self.served += 1
            if isinstance(c.sock, ssl.SSLSocket):
                c.sock.settimeout(self.timeout_s)
            else:
                kernel_timeouts(c.sock, self.timeout_s)
            send_all(c.sock, [_reply_head(runs, code, message), *runs])
            c.sock.setblocking(False)
            c.expect(_LENGTH.size)
            c.framed, c.deadline = False, time.monotonic() + IDLE_S
            with self._lock:
                if self._closed:
                    return
                self._back.append(c)
                kept = True
            with contextlib.suppress(OSError):  # (a full pipe: the leader is waking anyway)
                self._waker.send(b"\0", socket.MSG_DONTWAIT)
        except (OSError, BadFrame):
            return  # closed, timed out, or not a peer: nothing more written
        finally:
            if not kept:
                self._drop(c)

    def close(self, wait_s: float = 5.0) -> None:
        """Stop listening, end every connection, and wait up to ``wait_s`` for the listener's
        threads (one answering a request finishes it first): none is left answering while the
        process exits."""
        with self._lock:
            self._closed = True
            conns, threads = list(self._conns), self._threads
        for s in [self._sock, *conns]:
            shut_down(s)
        with contextlib.suppress(OSError):
            self._waker.send(b"\0", socket.MSG_DONTWAIT)
        if not threads:
            self._sock.close()
        deadline = time.monotonic() + wait_s
        for t in threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        if not any(t.is_alive() for t in threads):
            self._wake.close()
            self._waker.close()


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
        host, port = split_address(address)
        raw = socket.create_connection((host, port), timeout=connect_s)
        try:
            tune(raw)
            self.sock = raw if tls is None else tls.wrap_socket(raw, server_hostname=host)
            self.quiet_since = time.monotonic()  # (when it last finished a fetch)
            self.sock.settimeout(timeout_s)
            self.sock.sendall(ticket)
            if tls is None:
                kernel_timeouts(self.sock, timeout_s)
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
        shut_down(self.sock)

    def close(self) -> None:
        self.sock.close()
