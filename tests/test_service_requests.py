"""Bad requests to a real ``datastore serve`` get the right status and a short message, never
Python's exception text; nothing is decoded for a caller without the token; a long path is
refused at once. The service is a store of one node peering over gRPC (``--peers``), so its
``Peers`` service (``FetchBlocks``) answers too."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import h5py
import numpy as np
import pytest

from datastore.service._pb.v1 import datastore_pb2 as pb
from datastore.service._pb.v1 import datastore_pb2_grpc as pb_grpc
from staging.cluster import LAUNCH_ENV

ROOT = Path(__file__).parent.parent
SAMPLES = 8


def _accepts(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
    except OSError:
        return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """``(tcp address, token, dataset path, socket, log file)`` of one peered service."""
    tmp = tmp_path_factory.mktemp("requests")
    data = tmp / "allowed" / "data.h5"
    data.parent.mkdir()
    with h5py.File(data, "w") as f:
        f["x"] = np.arange(SAMPLES * 8 * 8 * 8, dtype=np.float32).reshape(SAMPLES, 1, 8, 8, 8)
    token = secrets.token_hex(8)
    token_file = tmp / "token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    tcp = f"127.0.0.1:{_free_port()}"
    sock = tmp / "s.sock"
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env.update(PYTHONPATH=str(ROOT), XDG_STATE_HOME=str(tmp / "state"))
    cmd = [sys.executable, "-m", "datastore", "serve", "--socket", str(sock), "--tcp", tcp,
           "--token-file", str(token_file), "--peers", tcp, "--node", "0",
           "--allow", str(data.parent)]  # fmt: skip
    log = tmp / "serve.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 60
    host, port = tcp.rsplit(":", 1)
    while not (sock.exists() and _accepts(host, int(port))):  # the Unix socket comes first
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    yield tcp, token, str(data), sock, log
    proc.terminate()
    proc.wait(30)


def fetch(tcp: str, token: str, **kw) -> grpc.RpcError:
    request = {"header": pb.PeerHeader(from_node=0, to_node=0, nodes=1), "samples": [0],
               "fields": ["x"], "block": 0, "pieces": True, **kw}  # fmt: skip
    with grpc.insecure_channel(tcp) as ch:
        call = ch.unary_stream(
            "/datastore.v1.Peers/FetchBlocks",
            request_serializer=pb.FetchBlocksRequest.SerializeToString,
            response_deserializer=None,
        )
        with pytest.raises(grpc.RpcError) as err:
            list(call(pb.FetchBlocksRequest(**request), timeout=20,
                      metadata=(("authorization", f"Bearer {token}"),)))  # fmt: skip
    return err.value


@pytest.mark.parametrize(
    ("kw", "code", "says"),
    [
        ({"samples": [SAMPLES]}, "OUT_OF_RANGE", f"sample {SAMPLES} is outside 0..7"),
        ({"fields": ["nope"]}, "NOT_FOUND", "no field 'nope' (fields: x)"),
        ({"spatial": pb.SpatialLayout(parts=[2, 1, 1]), "block": 2}, "OUT_OF_RANGE",
         "block 2 is outside 0..1"),
        ({"spatial": pb.SpatialLayout(parts=[0, 1, 1])}, "INVALID_ARGUMENT", "parts"),
        ({"spatial": pb.SpatialLayout(parts=[2, 1, 1], halo=[5, 0, 0])}, "INVALID_ARGUMENT",
         "halo"),
        ({"dataset_path": "/tmp/a\x00b"}, "INVALID_ARGUMENT", "NUL byte"),
    ],
    ids=["sample", "field", "block", "parts-0", "halo-too-wide", "nul"],
)  # fmt: skip
def test_bad_fetches_get_the_right_status(service, kw, code, says):
    tcp, token, path, *_ = service
    err = fetch(tcp, token, **{"dataset_path": path, **kw})
    assert err.code() == getattr(grpc.StatusCode, code), err.details()
    assert says in err.details(), err.details()
    assert "Traceback" not in err.details() and "Error:" not in err.details()


@pytest.mark.parametrize(
    "method",
    ["/datastore.v1.DataStore/OpenSession", "/datastore.v1.DataStore/StreamBatches",
     "/datastore.v1.DataStore/Stage", "/datastore.v1.Peers/FetchBlocks"],
)  # fmt: skip
def test_nothing_is_decoded_without_the_token(service, method):
    """Bytes that do not decode, sent raw over TCP: UNAUTHENTICATED without the token (or with
    another), whatever the kind of call; INVALID_ARGUMENT once the token is right."""
    tcp, token, *_ = service
    with grpc.insecure_channel(tcp) as ch:
        raw = ch.unary_unary(method, request_serializer=None, response_deserializer=None)
        for metadata in (None, (("authorization", "Bearer nope"),), (("authorization", token),)):
            with pytest.raises(grpc.RpcError) as err:
                raw(b"\xff\xff\xff\xff", timeout=10, metadata=metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            raw(b"\xff\xff\xff\xff", timeout=10, metadata=(("authorization", f"Bearer {token}"),))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()


def test_a_request_that_does_not_decode_is_invalid(service):
    _, _, _, sock, _ = service
    with grpc.insecure_channel(f"unix://{sock}") as ch:
        raw = ch.unary_unary("/datastore.v1.DataStore/LoadDataset", request_serializer=None,
                             response_deserializer=None)  # fmt: skip
        with pytest.raises(grpc.RpcError) as err:
            raw(b"\xff\xff\xff\xff", timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


LONG = "/a" * 150_000  # 300 KB, 150,000 components: resolving it took seconds


def _load(stub, path):
    return stub.LoadDataset(pb.LoadDatasetRequest(dataset_path=path), timeout=10)


def _open(stub, path):
    return stub.OpenSession(pb.OpenSessionRequest(dataset_path=path, global_batch=1), timeout=10)


def _unload(stub, path):
    return stub.UnloadDataset(pb.UnloadDatasetRequest(dataset_path=path), timeout=10)


def _stage_from(stub, path):
    return list(stub.Stage(pb.StageRequest(sources=[path], dest="/tmp/dest"), timeout=10))


def _stage_to(stub, path):
    return list(stub.Stage(pb.StageRequest(sources=["/tmp/src"], dest=path), timeout=10))


@pytest.mark.parametrize("call", [_load, _open, _unload, _stage_from, _stage_to])
@pytest.mark.parametrize(
    ("path", "says"),
    [(LONG, "is longer than 4096 bytes"), ("/tmp/x\x00y", "holds a NUL byte")],
    ids=["long", "nul"],
)
def test_a_bad_path_is_refused_at_once_without_echoing_it(service, call, path, says):
    _, _, _, sock, log = service
    with grpc.insecure_channel(f"unix://{sock}") as ch:
        stub = pb_grpc.DataStoreStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            call(stub, path)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert says in err.value.details()
    assert len(err.value.details()) < 400
    assert max(len(line) for line in log.read_text().splitlines()) < 10_000  # nor the log


def test_names_a_client_sent_are_not_echoed_whole(service):
    """An unknown session id or field name of 100,000 characters: the refusal quotes its
    start (a whole one would not even fit in gRPC's status); a job id that long is cut in the
    log."""
    _, _, path, sock, log = service
    with grpc.insecure_channel(f"unix://{sock}") as ch:
        stub = pb_grpc.DataStoreStub(ch)
        close = pb.CloseSessionRequest(session_id="s" * 100_000)
        open_ = pb.OpenSessionRequest(dataset_path=path, global_batch=1, fields=["f" * 100_000])
        for call, code in (
            (lambda: stub.CloseSession(close, timeout=10), grpc.StatusCode.NOT_FOUND),
            (lambda: stub.OpenSession(open_, timeout=10), grpc.StatusCode.INVALID_ARGUMENT),
        ):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == code, err.value.details()
            assert "(100000 characters)" in err.value.details()
            assert len(err.value.details()) < 400
        job = pb.OpenSessionRequest(dataset_path=path, global_batch=1, job_id="j" * 100_000)
        sid = stub.OpenSession(job, timeout=10).session_id
        stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)
    assert max(len(line) for line in log.read_text().splitlines()) < 10_000


def test_a_stream_cancelled_before_its_first_request_is_no_internal_error(service):
    """A loader closed while the stream of its next epoch's first batches opens cancels that
    call before its first request: the service logged each such call as ``internal_error``
    ("RpcError: ", level error), dozens in a minute of ordinary jobs."""
    *_, sock, log = service
    before = log.read_text().count("internal_error")
    with grpc.insecure_channel(f"unix://{sock}") as ch:
        stream = ch.stream_stream("/datastore.v1.DataStore/StreamBatches")
        for delay in (0, 0, 0.001, 0.005, 0.02):
            call = stream(iter(lambda: time.sleep(1), 1))  # (sends nothing for a while)
            time.sleep(delay)
            call.cancel()
    time.sleep(1)
    assert log.read_text().count("internal_error") == before


def test_a_call_beyond_the_workers_is_refused_at_once_not_kept_waiting(short_tmp):
    """Each stream holds a worker thread for its life: a 17th rank's stream on the 16 threads
    waited for one to end, and a job of 17 ranks hung at its first step."""
    import threading

    from datastore.service.listeners import bind_unix, new_server

    release = threading.Event()

    def stream(_request, _context):
        yield b"first"
        release.wait(10)

    handler = grpc.method_handlers_generic_handler(
        "t.T", {"S": grpc.unary_stream_rpc_method_handler(stream)}
    )
    server = new_server(2, [])
    server.add_generic_rpc_handlers((handler,))
    bind_unix(server, f"unix://{short_tmp}/s.sock")
    server.start()
    channel = grpc.insecure_channel(f"unix://{short_tmp}/s.sock")
    call = channel.unary_stream("/t.T/S")
    try:
        held = [call(b"", timeout=10) for _ in range(2)]
        assert [next(s) for s in held] == [b"first"] * 2
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            next(call(b"", timeout=5))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert time.monotonic() - t0 < 2
    finally:
        release.set()
        channel.close()
        server.stop(None)
