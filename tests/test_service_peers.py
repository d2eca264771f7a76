"""Two services started as separate processes (no shared MPI job) peer over gRPC as one store.

The dataset is staged with ``--mode shard`` into ``node{node}`` directories on this host; each
service (``--peers A0,A1 --node K``) owns the files of its node and fetches the blocks its ranks
need from the other one through ``datastore.v1.Peers`` on its TCP address, with the token.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from helpers import MPIEXEC, stage_sharded

from datastore.errors import ServiceUnavailable
from datastore.loader import DataStoreLoader
from datastore.service.client import Client
from datastore.service.errors import ServiceError
from datastore.service.grpc_answer import frame_chunk
from datastore.service.grpc_peers import GrpcPeers, chunk_view
from datastore.sources.options import ExchangeOptions, ServiceOptions
from staging.cluster import LAUNCH_ENV
from tests.test_service_stream import assert_same, batches

TOKEN = "peer-secret"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Store:
    """Two ``datastore serve --peers`` processes over one staged, sharded dataset."""

    def __init__(self, tmp, env):
        self.tmp, self.env = tmp, env
        self.addresses = [f"127.0.0.1:{_free_port()}" for _ in range(2)]
        self.sockets = [tmp / f"g{k}.sock" for k in range(2)]
        self.procs: list[subprocess.Popen | None] = [None, None]
        self.options: list[list[str]] = [[], []]  # more of each node's ``serve`` options
        (tmp / "token").write_text(TOKEN)
        (tmp / "token").chmod(0o600)

    def start(self, node: int) -> None:
        """Start node ``node``'s service; back once it listens (a restart: once the new one
        does, not on the socket file a killed service left behind)."""
        self.sockets[node].unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "datastore", "serve", "--socket", str(self.sockets[node])]
        cmd += ["--tcp", self.addresses[node], "--token-file", str(self.tmp / "token")]
        cmd += ["--peers", ",".join(self.addresses), "--node", str(node), "--peer-timeout", "3"]
        cmd += ["--state-file", str(self.tmp / f"state{node}.json"), *self.options[node]]
        log = open(self.tmp / f"serve{node}.log", "a")  # noqa: SIM115 - the child owns it
        self.procs[node] = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=log)
        log.close()
        deadline = time.monotonic() + 60
        while not self.sockets[node].exists():
            assert self.procs[node].poll() is None, (self.tmp / f"serve{node}.log").read_text()
            assert time.monotonic() < deadline, "the service did not start"
            time.sleep(0.1)

    def stop(self, node: int) -> int:
        proc = self.procs[node]
        proc.send_signal(signal.SIGTERM)
        return proc.wait(30)

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)


@contextlib.contextmanager
def two_services(tmp, kind=Store, write=None):
    """A dataset staged sharded under ``tmp`` (the 20 samples of ``stage_sharded``, or what
    ``write(src)`` writes) and both services of a ``kind`` store on it: ``(source dir, dataset
    template, store)``; the services are killed at the end."""
    src, env = stage_sharded(tmp, write)
    s = kind(tmp, env)
    try:
        s.start(0)
        s.start(1)
        yield src, str(tmp / "node{node}" / "src"), s
    finally:
        s.kill_all()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """``(source dir, dataset template, Store)``."""
    with two_services(tmp_path_factory.mktemp("peers")) as running:
        yield running


def _job(src, template, store, spatial, epochs=2):
    """Both ranks of a job, rank k on service k, against the embedded loader."""
    for rank in range(2):
        kw = {"rank": rank, "world": 2, "seed": 5, "spatial": spatial, "batch_size": 2}
        _as_embedded(src, template, store.sockets[rank], epochs, kw)


def _as_embedded(src, template, socket, epochs, kw):
    """One rank's batches through the service at ``socket`` against the embedded loader's."""
    remote = DataStoreLoader(template, service=ServiceOptions(str(socket)), **kw)
    local = DataStoreLoader(str(src), exchange=ExchangeOptions(enabled=False), **kw)
    try:
        for _ in range(epochs):
            assert_same(batches(remote), batches(local))
    finally:
        remote.close()
        local.close()


@pytest.mark.mpi
@pytest.mark.parametrize(
    "spatial", [None, {"parts": (2, 1, 1), "halo": (1, 1, 1)}], ids=["whole", "blocks"]
)
def test_a_job_across_two_grpc_peers_gets_the_embedded_batches(store, spatial):
    src, template, s = store
    _job(src, template, s, spatial)
    for node, sock in enumerate(s.sockets):
        with Client(sock) as c:
            st = c.status()
        assert (st.node, st.nodes) == (node, 2)
        assert st.bytes_exchanged > 0  # some of every batch lived on the other node
        (ds,) = st.datasets
        assert (ds.num_samples, ds.local_samples, ds.format) == (20, 10, "npy")
    table = subprocess.run(
        [sys.executable, "-m", "datastore", "status", "--socket", str(s.sockets[1])],
        capture_output=True,
        text=True,
        timeout=30,
        env=s.env,
    )
    assert table.returncode == 0 and "node 1 of 2, " in table.stdout and " fetched" in table.stdout


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("spatial", "transport", "prefetch"),
    [(None, "shm", 4), ({"parts": (2, 1, 1), "halo": (1, 1, 1)}, "inline", 1)],
    ids=["whole-shm-ahead3", "blocks-inline-ahead1"],
)
def test_grpc_fetch_ahead_keeps_the_embedded_batches_across_a_partial_step_and_epochs(
    store, spatial, transport, prefetch
):
    """Batches of 3 per rank over 20 samples: each epoch ends in a partial step (padded)."""
    src, template, s = store
    for rank in range(2):
        kw = {"rank": rank, "world": 2, "seed": 7, "spatial": spatial, "drop_last": False}
        service = ServiceOptions(str(s.sockets[rank]), transport=transport)
        remote = DataStoreLoader(template, batch_size=3, service=service, prefetch=prefetch, **kw)
        local = DataStoreLoader(
            str(src), batch_size=3, exchange=ExchangeOptions(enabled=False), **kw
        )
        try:
            for _ in range(3):
                got = batches(remote)
                assert not got[-1]["valid"].all()  # the partial last step, padded
                assert_same(got, batches(local))
        finally:
            remote.close()
            local.close()


def _with_scalars(src):
    for i in range(8):
        x = np.random.default_rng(i).standard_normal((1, 4, 2, 2)).astype(np.float32)
        np.savez(src / f"s{i}.npz", x=x, cls=np.int64(1000 + i))


@pytest.mark.mpi
def test_a_scalar_field_of_a_sharded_store_arrives_exactly(tmp_path):
    """A 0-d field (a class label): ``out[field][pos]`` is a copy, not a view, for it. A
    batch's local samples failed the stream (``INTERNAL``: copyto of a numpy.int64), and the
    other node's labels landed in a temporary, the batch keeping zeros."""
    with two_services(tmp_path, write=_with_scalars) as (src, template, s):
        kw = {"rank": 0, "world": 2, "seed": 1, "spatial": None, "batch_size": 2}
        _as_embedded(src, template, s.sockets[0], 1, kw)


@pytest.mark.mpi
def test_the_peer_api_answers_only_the_store_and_what_a_node_owns(store):
    _, template, s = store
    held = sorted(os.listdir(s.tmp / "node1" / "src"))
    as_node0 = GrpcPeers(tuple(s.addresses), 0, TOKEN, timeout_s=5)
    try:
        shardable, files, signature = as_node0.describe(1, template)
        assert shardable and files == held
        assert signature == {"data": ("float32", (2, 6, 4, 4))}
        # node 1 refuses to send what it does not own
        sample = next(i for i in range(20) if f"s{i:03d}.npy" not in held)
        request = {"path": template, "samples": [sample], "fields": ["data"]}
        request.update(spatial=None, block=0, pieces=True)
        with pytest.raises(ServiceError) as e:
            as_node0.fetch(1, request, np.empty(2 * 6 * 4 * 4 * 4, np.uint8))
        assert e.value.code == "FAILED_PRECONDITION" and "not on node 1" in str(e.value)
        # a peer of an older version, asking for whole boxes, is told to match versions
        owned = int(held[0][1:4])
        with pytest.raises(ServiceError) as e:
            older = {**request, "samples": [owned], "pieces": False}
            as_node0.fetch(1, older, np.empty(2 * 6 * 4 * 4 * 4, np.uint8))
        assert e.value.code == "FAILED_PRECONDITION" and "same version" in str(e.value)
        with pytest.raises(ServiceError) as e:
            as_node0.describe(1, str(s.tmp / "nowhere"))
        assert e.value.code == "NOT_FOUND"
    finally:
        as_node0.close(stop_all=False)
    # a service that thinks it is node 1 of a store of 3 is told the store is misconfigured
    as_node1 = GrpcPeers((*s.addresses, "127.0.0.1:9"), 2, TOKEN, timeout_s=5)
    try:
        with pytest.raises(ServiceError) as e:
            as_node1.describe(0, template)
        assert e.value.code == "FAILED_PRECONDITION" and "node 0 of 2" in str(e.value)
    finally:
        as_node1.close(stop_all=False)
    stranger = GrpcPeers(tuple(s.addresses), 0, "not-the-token", timeout_s=5)
    try:
        with pytest.raises(ServiceError) as e:
            stranger.describe(1, template)
        assert e.value.code == "FAILED_PRECONDITION" and "--token-file" in str(e.value)
    finally:
        stranger.close(stop_all=False)


@pytest.mark.mpi
def test_describe_gives_the_whole_store_where_a_node_holds_a_share(store):
    """What the trainer checks before training when its data comes from the service: each
    node holds 10 of the 20 files, and every address form reaches the whole store."""
    from trainer.start import describe

    _, template, s = store
    for node in range(2):
        assert len(os.listdir(s.tmp / f"node{node}" / "src")) == 10
    for address, token in [
        (str(s.sockets[0]), None), (f"unix://{s.sockets[1]}", None), (s.addresses[1], TOKEN)
    ]:  # fmt: skip
        with Client(address, token=token, timeout_s=20) as c:
            open_before = len(c.status().sessions)
            samples, fields = c.describe(template)
            assert len(c.status().sessions) == open_before  # its session is closed again
        assert samples == 20 and list(fields) == ["data"]
        f = fields["data"]
        assert (str(f.dtype), f.shape, f.spatial_axes) == ("float32", (2, 6, 4, 4), (1, 2, 3))
    found, samples = describe(template, str(s.sockets[1]), timeout=20)
    assert (found, samples) == ({"data": ("data", (2, 6, 4, 4), (1, 2, 3))}, 20)
    with pytest.raises(ValueError, match="config key 'data': no dataset at"):
        describe(str(s.tmp / "nowhere"), str(s.sockets[0]), timeout=20)


def _load(client, template, errors):
    try:
        client.load(template)
    except ServiceUnavailable as exc:
        errors.append(exc)


@pytest.mark.mpi
def test_a_stopped_peer_fails_requests_clearly_and_is_reached_again_once_back(store):
    src, template, s = store
    with Client(s.sockets[0], timeout_s=20) as c:
        c.load(template, wait=True)  # resident on node 0, who owns what known
    assert s.stop(1) == 0  # SIGTERM: it drains and exits; node 0 keeps serving
    assert not s.sockets[1].exists()
    kw = {"rank": 0, "world": 1, "seed": 9, "spatial": None}
    # the session's opening asks node 1 too (its files compared at most once a second): the
    # open fails, or, within that second of the load, the stream's first fetch
    with pytest.raises(ServiceUnavailable) as e:
        remote = DataStoreLoader(
            template, batch_size=4, service=ServiceOptions(str(s.sockets[0])), **kw
        )
        try:
            batches(remote)
        finally:
            remote.close()
    assert "node 1 (127.0.0.1:" in str(e.value) and "within 3 s" in str(e.value)
    with Client(s.sockets[0], timeout_s=20) as c:
        assert c.status().nodes == 2  # still serving
        assert c.unload(template).bytes_freed > 0
        errors: list[ServiceUnavailable] = []
        waiting = threading.Thread(target=_load, args=(c, template, errors))
        waiting.start()
        time.sleep(0.5)  # the load now waits for node 1 to describe its shard...
        assert not c.status().datasets  # ...and never holds up the others' calls:
        assert waiting.is_alive()  # answered while the load still waits
        waiting.join(20)
    (e,) = errors
    assert e.grpc_status == grpc.StatusCode.UNAVAILABLE and "node 1 (127.0.0.1:" in str(e)
    s.start(1)  # restarted: reloads its shard from the state file, and is reached again
    _job(src, template, s, None, epochs=1)


def _on_node0(src, template, s, epochs=1):
    """Both ranks of a job on node 0's service against the embedded loader over ``src``."""
    for rank in range(2):
        kw = {"rank": rank, "world": 2, "seed": 3, "batch_size": 3, "drop_last": False}
        _as_embedded(src, template, s.sockets[0], epochs, kw)


@pytest.mark.mpi
def test_new_data_staged_on_another_node_reaches_a_job_not_the_resident_copy(tmp_path):
    """A sharded dataset follows its files as one node's does: the services compared the
    files of none (a re-staged store served its first copy, sample count and bytes, for as
    long as it ran). Here only node 1's share changes (a file rewritten in place, one added)
    while a job reads through node 0 alone: node 0 sees node 1's listing change, and node 1,
    asked for it, its files."""
    with two_services(tmp_path) as (src, template, s):
        _on_node0(src, template, s)
        held = sorted(os.listdir(tmp_path / "node1" / "src"))
        time.sleep(1.1)  # (files are compared at most once a second)
        for where in (src, tmp_path / "node1" / "src"):  # as a stage would place them
            np.save(where / held[0], np.full((2, 6, 4, 4), 1000.0, np.float32))
            np.save(where / "s020.npy", np.full((2, 6, 4, 4), 2000.0, np.float32))
        _on_node0(src, template, s)  # 21 samples, the new bytes
        with Client(s.sockets[0]) as c:
            (ds,) = c.status().datasets
        assert ds.num_samples == 21
        time.sleep(1.1)
        os.remove(src / held[1])  # and one removed from node 1
        os.remove(tmp_path / "node1" / "src" / held[1])
        _on_node0(src, template, s)
        logs = [(tmp_path / f"serve{k}.log").read_text() for k in range(2)]
        assert all("dataset_changed" in log for log in logs)


def _certificate(tmp, name: str) -> tuple[Path, Path]:
    cert, key = tmp / f"{name}.pem", tmp / f"{name}.key"
    openssl = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
    openssl += ["-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost"]
    openssl += ["-addext", "subjectAltName=IP:127.0.0.1"]
    subprocess.run(openssl, check=True, capture_output=True)
    return cert, key


def test_a_peer_whose_tls_does_not_match_is_named_with_the_reason_not_a_timeout(tmp_path):
    """gRPC retries a refused handshake until the deadline and then only says it passed;
    the asking service names the TLS mismatch instead (and a peer merely down stays a
    timeout)."""
    (cert, key), (other, _) = _certificate(tmp_path, "node1"), _certificate(tmp_path, "other")
    s = Store(tmp_path, {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV})
    s.options[1] = ["--tls-cert", str(cert), "--tls-key", str(key)]
    try:
        s.start(1)  # node 0 is this process: a GrpcPeers asking node 1
        said = {}
        for case, ca in [("wrong CA", other), ("no TLS", None), ("its CA", cert)]:
            peers = GrpcPeers(tuple(s.addresses), 0, TOKEN, tls_ca=ca, timeout_s=1)
            try:
                with pytest.raises(ServiceError) as e:
                    peers.describe(1, str(tmp_path / "nothing"))
            finally:
                peers.close(stop_all=False)
            said[case] = (e.value.code, str(e.value))
        s.stop(1)
        peers = GrpcPeers(tuple(s.addresses), 0, TOKEN, tls_ca=other, timeout_s=1)
        with pytest.raises(ServiceError) as e:
            peers.describe(1, str(tmp_path / "nothing"))
        peers.close(stop_all=False)
        said["down"] = (e.value.code, str(e.value))
    finally:
        s.kill_all()
    at = f"node 1 ({s.addresses[1]}): "
    assert said["wrong CA"] == (
        "FAILED_PRECONDITION",
        at + "no TLS connection (CERTIFICATE_VERIFY_FAILED): every service of a store needs "
        "a --tls-cert that the others' --peer-ca signed",
    )
    assert said["no TLS"] == (
        "FAILED_PRECONDITION",
        at + "it talks TLS and this service does not: every service of a store needs "
        "--tls-cert and --tls-key, or none does",
    )
    assert said["its CA"][0] == "NOT_FOUND" and "TLS" not in said["its CA"][1]
    assert "Handshake failed" not in (tmp_path / "serve1.log").read_text()  # gRPC's lines
    assert said["down"] == (
        "UNAVAILABLE",
        f"node 1 ({s.addresses[1]}) did not answer Describe within 1 s",
    )


def test_chunk_framing_round_trips_and_rejects_garbage():
    data = np.arange(300, dtype=np.uint8)
    raw = frame_chunk(data)
    assert bytes(chunk_view(raw)) == data.tobytes()
    from datastore.service._pb.v1 import datastore_pb2 as pb

    assert pb.FetchBlocksResponse.FromString(raw).data == data.tobytes()
    assert bytes(chunk_view(pb.FetchBlocksResponse(data=b"xyz").SerializeToString())) == b"xyz"
    for bad in (b"\x12\x01x", raw[:-1], b"\x0a\xff"):
        with pytest.raises(ValueError):
            chunk_view(bad)


@pytest.mark.parametrize(
    "args, says",
    [
        (["--peers", "127.0.0.1:7001,127.0.0.1:7002", "--node", "0"], "--peers needs --tcp"),
        (["--tcp", "127.0.0.1:0", "--peers", "127.0.0.1:7001,127.0.0.1:7002"], "and --node"),
        (["--tcp", "127.0.0.1:0", "--peers", "a:1,b:2", "--node", "2"], "--node 2 is not"),
        (["--tcp", "127.0.0.1:0", "--peers", "a:1,b", "--node", "0"], "got 'b'"),
        (["--tcp", "127.0.0.1:0", "--peers", "a:1,a:1", "--node", "0"], "twice"),
        (["--node", "0"], "--node goes with --peers"),
        (
            ["--tcp", "127.0.0.1:7005", "--peers", "127.0.0.1:7001,127.0.0.1:7002", "--node", "1"],
            "--tcp 127.0.0.1:7005 is not on the port of --peers entry 1 (127.0.0.1:7002)",
        ),
    ],
    ids=[
        "no-tcp",
        "no-node",
        "node-out-of-range",
        "bad-address",
        "repeated",
        "node-alone",
        "tcp-not-its-peers-entry",
    ],
)
def test_bad_peer_options_exit_2_naming_the_option(tmp_path, args, says):
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    cmd = [sys.executable, "-m", "datastore", "serve", "--socket", str(tmp_path / "s.sock")]
    if "--tcp" in args:
        cmd += ["--token-file", str(token)]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    r = subprocess.run(cmd + args, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and says in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "s.sock").exists()


@pytest.mark.mpi
def test_peers_under_mpiexec_is_refused(tmp_path):
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", "-m", "datastore", "serve"]
    cmd += ["--socket", str(tmp_path / "s{rank}.sock"), "--tcp", "127.0.0.1:0"]
    cmd += ["--token-file", str(token), "--peers", "a:1,b:2", "--node", "0"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "under mpiexec the services of a store peer over MPI" in r.stderr
    assert not list(tmp_path.glob("*.sock"))


class _Failed(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


def test_a_peer_gone_mid_reply_is_not_blamed_on_the_service_the_client_asked():
    """Node 1 killed mid-epoch: node 0 says so (``node 1 ... the connection closed
    mid-reply``), and the loader told the user to check that node 0's service was running
    ("no answer from ADDRESS ...: is `datastore serve` running at ADDRESS?"), because the
    message held the word "connection"."""
    from datastore.service.client import raise_for

    peer = "node 1 (127.0.0.1:7433) broke off FetchBlocks (the connection closed mid-reply)"
    err = raise_for(_Failed(grpc.StatusCode.UNAVAILABLE, peer), "/run/n0.sock")
    assert isinstance(err, ServiceUnavailable)
    assert str(err) == f"datastore serve at /run/n0.sock: {peer}"
    nobody = "failed to connect to all addresses; last error: UNKNOWN: unix:/run/n0.sock"
    err = raise_for(_Failed(grpc.StatusCode.UNAVAILABLE, nobody), "/run/n0.sock")
    assert "is `datastore serve` running at /run/n0.sock?" in str(err)
