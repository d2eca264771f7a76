"""The gRPC peers' data connection (:mod:`datastore.service.data_link`): blocks over a plain
(or TLS) TCP socket beside gRPC, authorised by ``Peers/OpenData``.

In-process cases run a real ``Peers`` gRPC server and its data listener on loopback; the
others run two real ``datastore serve --peers`` processes over a sharded dataset.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from datastore.service import data_link, grpc_peers
from datastore.service._pb.v1 import datastore_pb2 as pb
from datastore.service.config import ServeConfig
from datastore.service.data_link import REPLY, TICKET, DataConnection, recv_bytes
from datastore.service.errors import ServiceError
from datastore.service.grpc_answer import PeersServicer, add_peers_to_server
from datastore.service.grpc_peers import GrpcPeers
from datastore.service.listeners import bind_data
from datastore.service.peer_link import Pieces
from datastore.service.peer_stats import STATS_ENV, read_stats
from staging.cluster import LAUNCH_ENV
from tests.test_service_peers import TOKEN, Store, _free_port, _job, two_services

# Stored samples of the in-process owner: sample i is (4, 70, 256) float32 of i*1000 + arange.
SHAPE = (4, 70, 256)


def _stored(i: int) -> np.ndarray:
    return (np.arange(np.prod(SHAPE), dtype=np.float32) + i * 1000).reshape(SHAPE)


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    """``(cert, key)``: a self-signed certificate for 127.0.0.1."""
    tmp = tmp_path_factory.mktemp("tls")
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    openssl = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
    openssl += ["-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost"]
    san = "subjectAltName=DNS:localhost,IP:127.0.0.1"
    subprocess.run([*openssl, "-addext", san], check=True, capture_output=True)
    return cert, key


def _peers_server(servicer, tls=None, host="127.0.0.1"):
    """A started gRPC server of ``servicer`` on ``host``: ``(it, its address on 127.0.0.1)``."""
    server = grpc.server(ThreadPoolExecutor(4))
    add_peers_to_server(servicer, server)
    if tls is None:
        port = server.add_insecure_port(f"{host}:0")
    else:
        pair = (tls[1].read_bytes(), tls[0].read_bytes())
        port = server.add_secure_port(f"{host}:0", grpc.ssl_server_credentials([pair]))
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture(params=[False, True], ids=["plain", "tls"])
def tls(request, cert):
    """``(cert, key)`` in the TLS case, ``None`` in the plaintext one."""
    return cert if request.param else None


@contextlib.contextmanager
def owner(answer, tls=None, timeout_s=10.0, host="127.0.0.1"):
    """Node 1 of 2: a real ``Peers`` server on ``host`` (loopback) and its data listener,
    answering with ``answer``; yields ``(its address on 127.0.0.1, the listener)``."""
    listener = bind_data(f"{host}:0", 0, *(tls or (None, None)), timeout_s)
    servicer = PeersServicer(1, 2, answer, lambda s: None, data=listener)
    server, address = _peers_server(servicer, tls, host)
    listener.start(servicer.serve_data)
    try:
        yield address, listener
    finally:
        server.stop(None)
        listener.close()


@contextlib.contextmanager
def linked(address, **options):
    """Node 0's link to the owner at ``address`` (``GrpcPeers`` options: a 10 s timeout
    unless told), closed at the end."""
    link = GrpcPeers(("127.0.0.1:9", address), 0, TOKEN, **{"timeout_s": 10, **options})
    try:
        yield link
    finally:
        link.close(stop_all=False)


def _flat() -> np.ndarray:
    """A fetch target for one stored sample, zeroed."""
    return np.zeros(_stored(0).nbytes, np.uint8)


def _holds(out: np.ndarray, i: int) -> bool:
    """Whether the flat ``out`` holds stored sample ``i`` exactly."""
    return np.array_equal(out.view(np.float32).reshape(SHAPE), _stored(i))


def _frame(samples) -> bytes:
    """A data connection's request frame of node 0 for ``samples`` (length, then request)."""
    header = pb.PeerHeader(from_node=0, to_node=1, nodes=2)
    raw = pb.FetchBlocksRequest(header=header, dataset_path="d", samples=samples)
    raw = raw.SerializeToString()
    return struct.pack("!I", len(raw)) + raw


def _data_conn(listener, ticket=None, cert=None) -> DataConnection:
    """A data connection of node 0 to ``listener`` (``ticket``: a fresh one of node 0)."""
    tls = None if cert is None else ssl.create_default_context(cafile=cert[0])
    ticket = listener.ticket(0) if ticket is None else ticket
    address = f"127.0.0.1:{listener.port}"
    return DataConnection(address, ticket, tls=tls, connect_s=5, timeout_s=10)


def _raw(listener, cert=None) -> socket.socket:
    """A bare (TLS: handshaken) connection to ``listener`` that has sent nothing."""
    sock = socket.create_connection(("127.0.0.1", listener.port), timeout=10)
    if cert is None:
        return sock
    return ssl.create_default_context(cafile=cert[0]).wrap_socket(sock, server_hostname="127.0.0.1")


def _reply(sock) -> bytes:
    """An OK reply's bytes, read off ``sock`` by hand."""
    code_n, message_n, total, count = REPLY.unpack(recv_bytes(sock, REPLY.size))
    head = recv_bytes(sock, code_n + message_n + 8 * count)
    assert code_n == 0, bytes(head)
    return bytes(recv_bytes(sock, total))


def _listener_threads(before) -> list[threading.Thread]:
    """The data listeners' threads started since ``before`` (``threading.enumerate()``)."""
    now = set(threading.enumerate()) - set(before)
    return [t for t in now if t.name.startswith("datastore-data")]


def _pieces(request):
    return Pieces([(_stored(i), (slice(None),) * 3) for i in request["samples"]])


def _ask(samples):
    return {
        "path": "d",
        "samples": samples,
        "fields": ["data"],
        "spatial": None,
        "block": 0,
        "pieces": True,
    }


def test_whole_samples_and_parts_amid_their_halo_arrive_exactly_over_the_data_connection(
    tls, tmp_path, monkeypatch
):
    """A whole sample into a flat buffer, and samples into boxes amid a halo (long runs:
    received in place; short runs, cut on the last axis: aside, then copied): the exact bytes,
    the halo of each box zeroed, the other samples' boxes untouched, every fetch answered by
    the data listener (not the gRPC stream), and its legs and run sizes in the peer stats."""
    monkeypatch.setenv(STATS_ENV, str(tmp_path / "stats{node}.jsonl"))
    with (
        owner(_pieces, tls=tls) as (address, listener),
        linked(address, tls_ca=tls and tls[0]) as link,
    ):
        flat = _flat()
        link.fetch(1, _ask([3]), flat)
        assert _holds(flat, 3)
        slot = np.full((2, 6, 72, 258), -1.0, np.float32)
        short_runs = (slice(1, 5), slice(1, 71), slice(1, 257))  # rows of 1 KiB
        long_slot = np.full((2, 6, 72, 256), -1.0, np.float32)
        long_runs = (slice(1, 5), slice(1, 71), slice(0, 256))  # runs of 70 KiB
        link.fetch(1, _ask([5, 6]), [(slot[0], short_runs), (long_slot[1], long_runs)])
        stored_short = np.full_like(slot, -1.0)
        stored_short[0] = 0
        stored_short[0][short_runs] = _stored(5)
        stored_long = np.full_like(long_slot, -1.0)
        stored_long[1] = 0
        stored_long[1][long_runs] = _stored(6)
        assert np.array_equal(slot, stored_short)
        assert np.array_equal(long_slot, stored_long)
        assert listener.served == 2  # both fetches over the data connection
    stats = read_stats(str(tmp_path / "stats0.jsonl"))
    n = _stored(0).nbytes
    assert stats["bytes"] == 3 * n and stats["fetches"] == [[n], [n, n]]
    assert all(to_first > 0 and to_last >= 0 for to_first, to_last in stats["legs"])


def test_fetches_in_ram_are_answered_at_once_the_others_by_answer():
    """Over the data connection and the gRPC stream alike, a fetch ``at_once`` answers (the
    servicer's samples in RAM: no path resolved) is sent from its reply; one it leaves
    (``None``) goes to ``answer``, as does every other request."""
    asked: list[tuple[str, list[int]]] = []

    def at_once(request):
        asked.append(("at_once", request["samples"]))
        return _pieces(request) if request["samples"][0] < 5 else None

    def answer(request):
        asked.append(("answer", request["samples"]))
        return _pieces(request)

    listener = bind_data("127.0.0.1:0", 0, None, None, 10.0)
    servicer = PeersServicer(1, 2, answer, lambda s: None, data=listener, at_once=at_once)
    server, address = _peers_server(servicer)
    listener.start(servicer.serve_data)
    streamed = PeersServicer(1, 2, answer, lambda s: None, at_once=at_once)  # no data port
    stream_server, stream_address = _peers_server(streamed)
    try:
        with linked(address) as link:
            for i in (3, 7):
                out = _flat()
                link.fetch(1, _ask([i]), out)
                assert _holds(out, i)
        with linked(stream_address) as link:
            out = _flat()
            link.fetch(1, _ask([4]), out)
            assert _holds(out, 4)
    finally:
        server.stop(None)
        stream_server.stop(None)
        listener.close()
    assert asked == [
        ("at_once", [3]),
        ("at_once", [7]),
        ("answer", [7]),
        ("at_once", [4]),
    ]
    assert listener.served == 2


def test_a_wrong_used_or_other_nodes_ticket_and_an_oversized_request_get_nothing():
    """The listener answers only a connection whose first bytes are a ticket it gave out,
    once, to the node that asks, and only requests of at most 16 MiB; anything else, and a
    connection silent past the timeout, is closed with nothing written."""
    asked = []

    def answer(request):
        asked.append(request["samples"])
        return _pieces(request)

    with owner(answer, timeout_s=5) as (_, listener):
        raw = _frame([1])[4:]
        into = _flat()

        def fetch(ticket):
            conn = _data_conn(listener, ticket)
            try:
                conn.fetch(raw, [into])
            finally:
                conn.close()

        with pytest.raises((EOFError, ConnectionError)):
            fetch(os.urandom(TICKET))  # never given out
        ticket = listener.ticket(0)
        fetch(ticket)  # the ticket's one use
        assert _holds(into, 1)
        with pytest.raises((EOFError, ConnectionError)):
            fetch(ticket)  # used
        with pytest.raises((EOFError, ConnectionError)):
            fetch(listener.ticket(1))  # node 1's ticket, a request of node 0
        with socket.create_connection(("127.0.0.1", listener.port), timeout=5) as s:
            s.sendall(listener.ticket(0) + struct.pack("!I", 16 * 1024 * 1024 + 1) + raw)
            with contextlib.suppress(ConnectionResetError):  # closed, the frame unread
                assert s.recv(1) == b""  # oversized: closed unanswered
        assert asked == [[1]] and listener.served == 1
    with owner(answer, timeout_s=1) as (_, listener):
        silent = socket.create_connection(("127.0.0.1", listener.port), timeout=30)
        with silent:
            assert silent.recv(1) == b""  # no ticket within the listener's timeout: closed
    assert asked == [[1]]


def test_abandon_returns_only_once_nothing_can_land():
    """A fetch abandoned while the owner is still answering: ``abandon`` returns with the
    fetch over, and the owner's reply, sent after, lands nowhere (before: abandon returned at
    once and the late reply was written into the batch slot)."""
    entered, release = threading.Event(), threading.Event()

    def answer(request):
        entered.set()
        release.wait(10)
        return _pieces(request)

    with owner(answer) as (address, _), linked(address) as link:
        try:
            out = _flat()
            pending = link.start(1, _ask([2]), out)
            assert entered.wait(10)
            pending.abandon()
            assert pending.wait(0)  # over when abandon returns
            release.set()
            time.sleep(0.3)  # the owner's reply goes out now, to a closed connection
            assert not out.any()
            with pytest.raises(ServiceError) as e:
                pending.result()
            assert e.value.code == "CANCELLED"
            link.fetch(1, _ask([4]), out)  # the link goes on, on a new connection
            assert _holds(out, 4)
        finally:
            release.set()


def test_an_unreachable_data_port_falls_back_to_the_grpc_stream_logged_once():
    """``OpenData`` names a port nothing listens on (a firewall open to gRPC only): the
    fetches come over ``FetchBlocks``, exact, and the link says so once."""
    with owner(_pieces) as (address, listener):
        listener.close()  # its port now refuses connections
        events = []
        told = lambda event, **fields: events.append((event, fields))  # noqa: E731
        with linked(address, on_event=told) as link:
            for i in (7, 8):
                out = _flat()
                link.fetch(1, _ask([i]), out)
                assert _holds(out, i)
    ((event, fields),) = events
    assert event == "peer_data_port_unreachable" and fields["node"] == 1
    assert f"127.0.0.1:{listener.port}" in fields["msg"] and "over gRPC" in fields["msg"]


# -- two real services ------------------------------------------------------------------------
class DataStore(Store):
    """:class:`~tests.test_service_peers.Store` with fixed ``--data-port``s."""

    def __init__(self, tmp, env):
        super().__init__(tmp, env)
        self.data_ports = [_free_port() for _ in range(2)]
        self.options = [["--data-port", str(port)] for port in self.data_ports]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    with two_services(tmp_path_factory.mktemp("data-link"), DataStore) as running:
        yield running


def _connected(port: int, want: int | None = None, within: float = 2.0) -> int:
    """The established TCP connections to ``port`` on this host (``/proc/net/tcp``); with
    ``want``, read again until that many are seen or ``within`` s passed (the file is read a
    page at a time, each read resuming where the last stopped: while other processes open and
    close sockets, one reading can miss rows)."""
    deadline = time.monotonic() + within
    while True:
        with open("/proc/net/tcp") as f:
            rows = [line.split() for line in f.readlines()[1:]]
        got = sum(int(r[1].split(":")[1], 16) == port and r[3] == "01" for r in rows)
        if want is None or got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


@pytest.mark.mpi
@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="Linux's /proc/net/tcp")
def test_two_services_exchange_over_their_data_connections_the_embedded_batches(store):
    """Whole samples and half-blocks with halo, both ranks: the batches of the embedded
    loader, the blocks carried by data connections on both services' ``--data-port`` (they
    stay open for the next fetches), no fallback logged."""
    src, template, s = store
    for spatial in (None, {"parts": (2, 1, 1), "halo": (1, 1, 1)}):
        _job(src, template, s, spatial, epochs=1)
    assert all(_connected(port) for port in s.data_ports)
    for node in range(2):
        log = (s.tmp / f"serve{node}.log").read_text()
        assert "peer_data_port_unreachable" not in log
        assert f'"data_port":{s.data_ports[node]}' in log


def _stop(proc: subprocess.Popen) -> None:
    """SIGSTOP ``proc`` and wait until every thread of it is stopped (a thread running on
    another core finishes what it was doing first)."""
    proc.send_signal(signal.SIGSTOP)
    tasks = f"/proc/{proc.pid}/task"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        states = []
        for t in os.listdir(tasks):
            with contextlib.suppress(OSError), open(f"{tasks}/{t}/stat") as f:
                states.append(f.read().rpartition(")")[2].split()[0])
        if states and all(st in "tT" for st in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {proc.pid} did not stop")


def test_a_stalled_or_killed_peer_fails_naming_it_and_a_restarted_one_is_reached(store):
    """Node 1 stopped (SIGSTOP) with a data connection open: the fetch fails ``UNAVAILABLE``
    naming it at the timeout; killed while a fetch waits on it: at once; restarted: the next
    fetch opens a new data connection."""
    _, template, s = store
    held = set(os.listdir(s.tmp / "node1" / "src"))
    sample = next(i for i in range(20) if f"s{i:03d}.npy" in held)
    request = {**_ask([sample]), "path": template}
    link = GrpcPeers(tuple(s.addresses), 0, TOKEN, timeout_s=1)
    out = np.zeros(2 * 6 * 4 * 4 * 4, np.uint8)
    try:
        link.fetch(1, request, out)  # a data connection, now idle
        assert out.view(np.float32)[0] == sample
        _stop(s.procs[1])
        with pytest.raises(ServiceError) as e:
            link.fetch(1, request, out)
        assert e.value.code == "UNAVAILABLE" and f"node 1 ({s.addresses[1]})" in str(e.value)
        assert "within 1 s" in str(e.value)
        slow = GrpcPeers(tuple(s.addresses), 0, TOKEN, timeout_s=60)
        try:
            s.procs[1].send_signal(signal.SIGCONT)
            slow.fetch(1, request, out)  # connected while node 1 runs...
            _stop(s.procs[1])
            pending = slow.start(1, request, out)  # ...then waiting on a stopped node 1
            time.sleep(0.2)
            s.procs[1].kill()
            assert pending.wait(20), "the fetch still waits on a killed peer"
            with pytest.raises(ServiceError) as e:
                pending.result()
            assert e.value.code == "UNAVAILABLE" and f"node 1 ({s.addresses[1]})" in str(e.value)
            assert "broke off FetchBlocks" in str(e.value)  # on its data connection
        finally:
            slow.close(stop_all=False)
        s.procs[1].wait(10)
        s.start(1)
        out[:] = 0
        link.timeout_s = 20  # the restarted node reloads its shard
        link.fetch(1, request, out)
        assert out.view(np.float32)[0] == sample
    finally:
        link.close(stop_all=False)


def _serve(tmp_path, *args) -> subprocess.CompletedProcess:
    """``datastore serve`` on ``tmp_path``'s socket and ``127.0.0.1:0`` with a token, and
    ``args``, run to its end (outside any launcher)."""
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env.update(XDG_RUNTIME_DIR=str(tmp_path), XDG_STATE_HOME=str(tmp_path / "state"))
    cmd = [sys.executable, "-m", "datastore", "serve", "--socket", str(tmp_path / "s.sock")]
    cmd += ["--tcp", "127.0.0.1:0", "--token-file", str(token), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize(
    "args, says",
    [
        (["--peers", "127.0.0.1:7001,127.0.0.1:7002", "--node", "0", "--data-port", "70000"],
         "argument --data-port: must be a whole number 0..65535"),
        (["--data-port", "7003"], "--data-port goes with --peers"),
    ],
    ids=["out-of-range", "without-peers"],
)  # fmt: skip
def test_bad_data_port_options_exit_2_naming_the_option(tmp_path, args, says):
    r = _serve(tmp_path, *args)
    assert r.returncode == 2 and says in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_data_port_equal_to_the_tcp_port_is_bad_usage_naming_both(tmp_path):
    """``--tcp 127.0.0.1:47433 --data-port 47433`` started, then stopped with exit 1 "Address
    already in use": a conflict the arguments show is bad usage (exit 2), said before binding."""
    peers = ("127.0.0.1:47433", "127.0.0.1:47434")
    same = dict(socket=tmp_path / "s.sock", token_file=tmp_path / "t", peers=peers, node=0)
    says = "^--data-port 47433 is the port of --tcp 127.0.0.1:47433: give each its own$"
    with pytest.raises(ValueError, match=says):
        ServeConfig(tcp="127.0.0.1:47433", data_port=47433, **same)
    assert ServeConfig(tcp="127.0.0.1:47433", data_port=47435, **same).data_port == 47435


def test_a_data_port_in_use_fails_the_start_naming_it(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        peers = ["--peers", "127.0.0.1:7001,127.0.0.1:7002", "--data-port", str(port)]
        r = _serve(tmp_path, "--node", "0", *peers)
    assert r.returncode == 1 and "cannot_listen" in r.stderr, r.stderr
    assert f'"data_port":{port}' in r.stderr and "Address already in use" in r.stderr
    assert not (tmp_path / "s.sock").exists()


def test_closing_the_listener_ends_its_idle_connections(tls):
    """A stopping service's listener ends the connections its peers keep between fetches:
    the listener's threads exit and the asker sees the end (before: under TLS the wrapped
    socket was left open, its thread waiting for a next request for good)."""
    before = threading.enumerate()
    with (
        owner(_pieces, tls=tls) as (address, listener),
        linked(address, tls_ca=tls and tls[0]) as link,
    ):
        link.fetch(1, _ask([1]), _flat())  # its connection now idles, kept for the next
        (kept,) = link._idle[1]
        listener.close()
        kept.sock.settimeout(5)
        assert kept.sock.recv(1) == b""  # the owner ended it (not a 5 s timeout)
        assert not _listener_threads(before)  # (close waited for them)


def test_abandoning_a_fetch_that_waits_for_a_down_peer_cancels_it_at_once():
    """A stream stopped while an owner is down (its ``OpenData`` waiting for it to come up):
    the fetch is cancelled, not left to fail ``UNAVAILABLE`` at the peer timeout (before:
    ``abandon`` waited out the whole timeout, holding up the stream's stop)."""
    with linked(f"127.0.0.1:{_free_port()}", timeout_s=5) as link:
        pending = link.start(1, _ask([0]), _flat())
        time.sleep(0.3)  # (its OpenData is waiting for the peer by now)
        pending.abandon()
        assert pending.wait(0)
        with pytest.raises(ServiceError) as e:
            pending.result()
        assert e.value.code == "CANCELLED" and "node 1 (127.0.0.1:" in str(e.value)


def test_a_ticket_dripped_byte_by_byte_is_cut_off_at_the_timeout():
    """A connection that never presents a whole ticket within the listener's timeout is
    closed, however it spaces its bytes (before: each byte reset the timeout, so anyone who
    could reach the port held a thread and a socket for as long as they dripped)."""
    with owner(_pieces, timeout_s=2) as (_, listener):
        with socket.create_connection(("127.0.0.1", listener.port), timeout=5) as s:
            with contextlib.suppress(ConnectionError):  # (closed while dripping)
                for _ in range(8):  # 8 bytes over 4 s: each well within the timeout
                    s.sendall(b"x")
                    time.sleep(0.5)
            s.settimeout(0.5)  # closed 2 s ago by now: not still waiting for the next byte
            with contextlib.suppress(ConnectionResetError):
                assert s.recv(1) == b""
        assert listener.served == 0


def test_closing_the_link_ends_a_fetch_in_flight_to_a_hung_owner():
    """A service stopping while one of its fetches waits on a hung owner: closing the link
    ends that fetch at once (before: the data connection was left to its timeout, and the
    service's exit waited for it, as Python joins the fetch pool's threads; the gRPC
    stream's fetches ended with the channel)."""
    entered, release = threading.Event(), threading.Event()

    def answer(request):
        entered.set()
        release.wait(20)
        return _pieces(request)

    with owner(answer, timeout_s=20) as (address, _), linked(address, timeout_s=20) as link:
        try:
            pending = link.start(1, _ask([2]), _flat())
            assert entered.wait(10)
            link.close(stop_all=False)
            assert pending.wait(5)  # not left waiting for the owner's reply
            with pytest.raises(ServiceError) as e:
                pending.result()
            assert e.value.code == "UNAVAILABLE" and "node 1 (127.0.0.1:" in str(e.value)
            assert "stopping" in str(e.value)
        finally:
            release.set()


@pytest.mark.skipif(not socket.has_dualstack_ipv6(), reason="no dual-stack IPv6 here")
def test_a_service_on_every_address_takes_ipv4_peers_on_its_data_port_too():
    """``--tcp [::]:PORT``: gRPC takes IPv4 peers, and so does the data listener (before: it
    was IPv6-only, so IPv4 peers fell back to the slower gRPC stream, told to open a port
    that was open)."""
    with owner(_pieces, host="[::]") as (address, listener):
        events = []
        with linked(address, on_event=lambda event, **fields: events.append(event)) as link:
            out = _flat()
            link.fetch(1, _ask([3]), out)
            assert _holds(out, 3)
        assert events == [] and listener.served == 1  # over the data connection


def test_a_data_connection_is_reused_by_a_service_with_over_1024_files_open():
    """A service holding many files (a dataset's shards, clients' rings) still keeps its data
    connections for the next fetch (before: ``select`` cannot take a descriptor above 1023,
    so every fetch paid a new ``OpenData`` and connection)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"at most {hard} open files here")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        with owner(_pieces) as (address, _), linked(address) as link:
            out = _flat()
            link.fetch(1, _ask([1]), out)
            (first,) = link._idle[1]
            assert first.sock.fileno() > 1023
            link.fetch(1, _ask([2]), out)
            assert link._idle[1] == [first]  # the same connection, reused
            assert _holds(out, 2)
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_data_port_opened_later_is_used_again_after_the_retry_pause(monkeypatch):
    """Fallen back to gRPC (the data port refused), the link tries the data connection again
    after ``RETRY_S`` and, the port open by then, fetches over it; a second failure later
    would be told again."""
    monkeypatch.setattr(grpc_peers, "RETRY_S", 0.5)
    closed = bind_data("127.0.0.1:0", 0, None, None, 10.0)
    port = closed.port
    closed.close()  # its port now refuses connections
    servicer = PeersServicer(1, 2, _pieces, lambda s: None, data=closed)
    server, address = _peers_server(servicer)
    events, opened = [], None
    try:
        with linked(address, on_event=lambda event, **fields: events.append(event)) as link:
            out = _flat()
            link.fetch(1, _ask([3]), out)  # over gRPC
            opened = bind_data(f"127.0.0.1:{port}", port, None, None, 10.0)
            opened.start(servicer.serve_data)
            servicer._data = opened  # the port is open now (a firewall rule added)
            link.fetch(1, _ask([4]), out)  # within the pause: still over gRPC
            assert opened.served == 0
            time.sleep(0.6)
            link.fetch(1, _ask([5]), out)
            assert _holds(out, 5)
            assert opened.served == 1, "the data connection was not tried again"
    finally:
        server.stop(None)
        if opened is not None:
            opened.close()
    assert events == ["peer_data_port_unreachable"]


def test_a_flood_of_connections_without_tickets_is_turned_away_and_peers_still_served(
    monkeypatch,
):
    """More connections waiting to present a ticket than ``MAX_UNTICKETED`` are closed at
    once, unanswered (each would hold a socket until the timeout); once those go, a peer's
    fetch is served as before."""
    monkeypatch.setattr(data_link, "MAX_UNTICKETED", 2)
    with owner(_pieces) as (address, listener):
        silent = [socket.create_connection(("127.0.0.1", listener.port)) for _ in range(2)]
        time.sleep(0.3)  # both accepted, waiting for their tickets
        extra = socket.create_connection(("127.0.0.1", listener.port))
        extra.settimeout(5)
        assert extra.recv(1) == b"", "a connection over the limit was kept open"
        extra.close()
        for s in silent:
            s.close()
        time.sleep(0.3)  # the listener sees them close and stops counting them
        with linked(address) as link:
            out = _flat()
            link.fetch(1, _ask([6]), out)
            assert _holds(out, 6)
            assert listener.served == 1


def test_an_unused_data_connection_is_closed_by_its_owner_and_the_asker_opens_another(
    monkeypatch,
):
    """The owner closes a data connection that brought no request for ``IDLE_S`` (its socket
    freed); the asker, finding it closed, fetches over a new one."""
    monkeypatch.setattr(data_link, "IDLE_S", 0.5)
    with owner(_pieces) as (address, listener), linked(address) as link:
        out = _flat()
        link.fetch(1, _ask([1]), out)
        assert _connected(listener.port, 1) == 1
        time.sleep(1.5)
        assert _connected(listener.port, 0) == 0, "an unused data connection was kept open"
        link.fetch(1, _ask([2]), out)
        assert _holds(out, 2)
        assert listener.served == 2 and _connected(listener.port, 1) == 1


def test_an_asker_does_not_reuse_a_data_connection_that_sat_unused_too_long(monkeypatch):
    """A connection back in the asker's pool longer than ``REUSE_S`` is closed and a new one
    opened (the owner may be about to close it at ``IDLE_S``); a fresh one is reused."""
    monkeypatch.setattr(grpc_peers, "REUSE_S", 0.5)
    with owner(_pieces) as (address, listener), linked(address) as link:
        out = _flat()
        link.fetch(1, _ask([1]), out)
        (first,) = link._idle[1]
        link.fetch(1, _ask([2]), out)
        assert link._idle[1] == [first], "a fresh connection was not reused"
        time.sleep(0.8)
        link.fetch(1, _ask([3]), out)
        assert _holds(out, 3)
        (second,) = link._idle[1]
        assert second is not first and first.sock.fileno() == -1
        assert listener.served == 3


def test_a_fetch_or_describe_after_the_link_closed_is_refused_at_once():
    """After ``close`` (a service stopping), a fetch queued before it or asked after it, and a
    describe, are refused ``UNAVAILABLE`` at once: no channel is opened again to wait for a
    peer that may be gone (which held up the service's exit past Slurm's KillWait)."""
    link = GrpcPeers(("127.0.0.1:9", "127.0.0.1:1"), 0, TOKEN, timeout_s=30)
    link.close(stop_all=False)
    out = _flat()
    t0 = time.monotonic()
    pending = link.start(1, _ask([1]), out)
    assert pending.wait(5)
    for call in (pending.result, lambda: link.fetch(1, _ask([1]), out),
                 lambda: link.describe(1, "d")):  # fmt: skip
        with pytest.raises(ServiceError) as e:
            call()
        assert e.value.code == "UNAVAILABLE" and "this service is stopping" in str(e.value)
        assert "node 1 (127.0.0.1:1)" in str(e.value)
    assert time.monotonic() - t0 < 5
    assert link._channels == {}


# -- many connections, one watcher ------------------------------------------------------------
def test_many_idle_data_connections_hold_a_bounded_number_of_threads(tls):
    """64 data connections, each after a fetch idle and kept open (an asker keeps 8 per
    peer, an owner of a store of hundreds of nodes hundreds to thousands): the listener
    runs a watcher and its answering threads, however many are open (before: a thread per
    connection), and every connection gets exact bytes on its next fetch."""
    before = threading.enumerate()
    with owner(_pieces, tls=tls) as (_, listener):
        conns = [_data_conn(listener, cert=tls) for _ in range(64)]
        try:
            for round_ in range(2):
                for i, conn in enumerate(conns):
                    out = _flat()
                    conn.fetch(_frame([i + round_])[4:], [out])
                    assert _holds(out, i + round_)
                threads = _listener_threads(before)
                assert len(threads) <= 1 + data_link.WORKERS, [t.name for t in threads]
                assert _connected(listener.port, 64) == 64  # all kept open, idle
            assert listener.served == 128
        finally:
            for conn in conns:
                conn.close()


def test_tickets_dripped_on_many_connections_hold_up_no_other_connections_fetch(tls):
    """Twice as many connections as answering threads drip their tickets a byte at a time
    (and as many more stop mid-handshake, or mid-ticket in plaintext): between their bytes,
    another connection's fetches are answered at once (none waits for a dripped ticket's
    timeout), the listener's threads stay bounded, and each dripping connection, once its
    ticket and request are whole, gets exact bytes."""
    before = threading.enumerate()
    with owner(_pieces, tls=tls, timeout_s=30) as (_, listener):
        dripping = [_raw(listener, tls) for _ in range(2 * data_link.WORKERS)]
        stuck = [_raw(listener) for _ in range(data_link.WORKERS)]
        tickets = [listener.ticket(0) for _ in dripping]
        peer = _data_conn(listener, cert=tls)
        try:
            for s in stuck:
                s.sendall(b"\x16")  # (a TLS handshake record's first byte)
            for k in range(3):
                for s, ticket in zip(dripping, tickets, strict=True):
                    s.sendall(ticket[k : k + 1])
                out = _flat()
                peer.fetch(_frame([k])[4:], [out])  # (its socket times out after 10 s)
                assert _holds(out, k)
                threads = _listener_threads(before)
                assert len(threads) <= 1 + data_link.WORKERS, [t.name for t in threads]
            for i, (s, ticket) in enumerate(zip(dripping, tickets, strict=True)):
                s.sendall(ticket[3:] + _frame([i]))
                assert _reply(s) == _stored(i).tobytes()
            assert listener.served == 3 + len(dripping)
        finally:
            for s in [*dripping, *stuck]:
                s.close()
            peer.close()


def test_a_ticket_and_requests_sent_at_once_are_all_answered(tls):
    """A ticket and two requests in one send (over TLS, one record: the requests wait in the
    TLS buffer, decrypted, where the socket shows nothing more to read): both are answered,
    in order, exact."""
    with owner(_pieces, tls=tls) as (_, listener), _raw(listener, tls) as s:
        s.sendall(listener.ticket(0) + _frame([4]) + _frame([9]))
        assert _reply(s) == _stored(4).tobytes()
        assert _reply(s) == _stored(9).tobytes()
        assert listener.served == 2


def test_answered_connections_handed_back_at_once_are_all_watched_again():
    """Rounds of two fetches at once on two connections, each round waiting for both (as a
    stream waits for a batch's fetches): the two replies' threads hand their connections back
    to the watcher at about the same time, and each next request is read as it comes.
    Before, the watcher could take the connections handed back so far, then drain the
    wake-up byte of one handed back just after: that one was left unwatched with nothing
    else to wake the watcher, its fetch waiting out the next deadline (a 60 s stall in
    benchmarks/peers.py; here the asker's 10 s timeout)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # the threads interleave every few bytecodes
    rounds = 300
    with owner(_pieces, timeout_s=60) as (_, listener):
        conns = [_data_conn(listener) for _ in range(2)]
        both = threading.Barrier(len(conns), timeout=30)

        def fetch(k: int, i: int) -> None:
            out = _flat()
            conns[k].fetch(_frame([i])[4:], [out])
            assert _holds(out, i)

        def fetches(k: int) -> int:
            try:
                for n in range(rounds):
                    both.wait()
                    fetch(k, k + n)  # both at once
                    both.wait()
                    if n % 2 == k:  # then one alone: the other cannot wake the watcher
                        fetch(k, n)
            except threading.BrokenBarrierError:
                return 0  # the other thread failed: its error is the test's
            except BaseException:
                both.abort()  # (the other thread stops at once)
                raise
            return rounds

        try:
            with ThreadPoolExecutor(len(conns)) as pool:
                assert sum(pool.map(fetches, range(len(conns)))) == 2 * rounds
            assert listener.served == 3 * rounds
        finally:
            sys.setswitchinterval(interval)
            for conn in conns:
                conn.close()


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="Linux's /proc/net/tcp")
def test_askers_that_stop_reading_free_the_answering_threads_at_the_timeout():
    """One more connection than answering threads asks for 64 samples (18 MiB, more than the
    sockets buffer) and never reads: each thread's send times out in the kernel after the
    listener's 1 s (``SO_SNDTIMEO``) and drops that connection; meanwhile the listener still
    reads tickets and requests (another connection's 1 s ticket does not expire unread), and
    that connection's fetch, answered once a thread is free, is exact."""
    with owner(_pieces, timeout_s=1) as (_, listener):
        stalled = [_raw(listener) for _ in range(data_link.WORKERS + 1)]
        try:
            for s in stalled:
                s.sendall(listener.ticket(0) + _frame(list(range(64))))
            out, peer = _flat(), _data_conn(listener)  # (its socket times out after 10 s)
            try:
                peer.fetch(_frame([5])[4:], [out])
            finally:
                peer.close()
            assert _holds(out, 5)
            deadline = time.monotonic() + 10  # every stalled one answered, then dropped
            while _connected(listener.port) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _connected(listener.port, 0) == 0
            assert listener.served == data_link.WORKERS + 2
            for s in stalled:  # dropped mid-reply: fewer bytes than the reply's
                s.settimeout(10)
                got = 0
                while chunk := s.recv(1 << 20):
                    got += len(chunk)
                assert 0 < got < 64 * _stored(0).nbytes
        finally:
            for s in stalled:
                s.close()


def test_a_listener_closed_before_it_started_starts_nothing():
    """A service stopping before its data listener started (``close`` then ``start``):
    ``start`` starts no thread and raises nothing (it registered the closed wake-up socket
    before it looked at the close, and raised ``ValueError``)."""
    before = threading.enumerate()
    listener = bind_data("127.0.0.1:0", 0, None, None, 5.0)
    listener.close()
    listener.start(lambda raw, node: [])
    assert _listener_threads(before) == []


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _serve_nothing(request: bytes, node: int) -> list:
    return []


def test_a_listener_closed_while_it_starts_leaves_no_thread_or_socket_behind():
    """``close`` racing ``start`` (a service stopping as it comes up): neither fails, and once
    both returned no listener thread or descriptor is left. Before, a close between ``start``
    publishing its threads and starting them raised ``RuntimeError: cannot join thread before
    it is started``."""
    threads, fds = threading.enumerate(), _fds()
    for k in range(60):  # the close later each time, across the start's span
        listener = data_link.DataListener("127.0.0.1")
        both, errors = threading.Barrier(2), []

        def start(listener=listener, both=both, errors=errors):
            both.wait()
            try:
                listener.start(_serve_nothing)
            except Exception as exc:
                errors.append(repr(exc))

        racer = threading.Thread(target=start)
        racer.start()
        both.wait()
        time.sleep(k * 0.00005)
        listener.close()
        racer.join()
        assert errors == []
    assert not _listener_threads(threads)
    assert _fds() == fds


def test_a_listener_started_twice_refuses_the_second_start():
    threads, fds = threading.enumerate(), _fds()
    listener = data_link.DataListener("127.0.0.1")
    listener.start(_serve_nothing)
    with pytest.raises(ServiceError, match="runs already") as again:
        listener.start(_serve_nothing)
    assert again.value.code == "FAILED_PRECONDITION"
    assert len(_listener_threads(threads)) == data_link.WORKERS + 1
    listener.close()
    assert not _listener_threads(threads)
    assert _fds() == fds


def test_closing_a_listener_mid_handshake_raises_in_none_of_its_threads(cert, monkeypatch):
    """The listener closed while its watcher reads TLS handshakes from connections that close:
    every round ends without an exception in the listener's threads. Before, `close` shut the
    connections down through `SSLSocket.shutdown`, which drops their TLS state under the
    watcher: its next `do_handshake` raised `AttributeError` and the thread died with a
    traceback on the service's stderr."""
    raised = []
    monkeypatch.setattr(threading, "excepthook", raised.append)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # the threads interleave every few bytecodes
    try:
        for _ in range(40):
            listener = bind_data("127.0.0.1:0", 0, *cert, 10.0)
            listener.start(lambda request, node: [])
            conns = [_raw(listener) for _ in range(8)]
            for s in conns:
                s.sendall(b"\x16")  # (a TLS handshake record's first byte)
            for s in conns:
                s.close()
            listener.close()
    finally:
        sys.setswitchinterval(interval)
    assert [(a.exc_type, a.exc_value) for a in raised] == []


def test_a_tls_fetch_stopped_mid_reply_ends_with_the_connections_error(cert):
    """``DataConnection.stop`` from another thread while a TLS reply streams in (as a peers'
    ``close`` or an abandoned fetch does): the fetch ends with ``OSError`` or ``EOFError``, the
    errors its callers handle, or completes with exact bytes. Before, ``stop`` went through
    ``SSLSocket.shutdown``, which drops the TLS state: the fetching thread then read the
    ciphertext still queued as plaintext, and blamed the owner for a garbled reply
    (``PeerError('a reply of 695747755 runs')``; about half the runs of this test)."""
    samples = list(range(48))
    whole = np.concatenate([_stored(i).view(np.uint8).ravel() for i in samples])
    wrong = []
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # the threads interleave every few bytecodes
    try:
        with owner(_pieces, tls=cert) as (_, listener):
            for r in range(125):
                conn = _data_conn(listener, cert=cert)
                out = np.zeros(len(samples) * _stored(0).nbytes, np.uint8)
                # 0-2.4 ms on: before the reply, or within it
                stop = threading.Timer(0.0001 * (r % 25), conn.stop)
                stop.start()
                try:
                    conn.fetch(_frame(samples)[4:], [out])
                except (OSError, EOFError):
                    pass
                except Exception as exc:  # (what the test looks for)
                    wrong.append(exc)
                else:  # finished before the stop: exact
                    if not np.array_equal(out, whole):
                        wrong.append(f"round {r}: a fetch ended without error, its bytes wrong")
                finally:
                    stop.join()
                    conn.close()
    finally:
        sys.setswitchinterval(interval)
    assert wrong == []


def test_a_jobs_failure_is_told_to_the_other_nodes():
    """A rank's stream failed on node 0: node 1 is told (``JobFailed``), so that its streams
    of the job end too; over gRPC the other nodes were never told."""
    told = queue.Queue()

    def answer(request):
        told.put(request)
        return 1

    failed = {"kind": "job_failed", "job": '["j", "/d", 2, 4, 0]', "why": "rank 1 of job 'j'..."}
    with owner(answer) as (address, _), linked(address) as link:
        link.tell_all(failed)  # (returns at once)
        assert told.get(timeout=10) == failed
