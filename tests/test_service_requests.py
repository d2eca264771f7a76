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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """``(tcp address, token, dataset path, socket)`` of one peered service."""
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
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not sock.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.1)
    yield tcp, token, str(data), sock
    proc.terminate()
    proc.wait(30)


def fetch(tcp: str, token: str, **kw) -> grpc.RpcError:
    request = {"header": pb.PeerHeader(from_node=0, to_node=0, nodes=1), "samples": [0],
               "fields": ["x"], "block": 0, **kw}  # fmt: skip
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
    tcp, token, path, _ = service
    err = fetch(tcp, token, **{"dataset_path": path, **kw})
    assert err.code() == getattr(grpc.StatusCode, code), err.details()
    assert says in err.details(), err.details()
    assert "Traceback" not in err.details() and "Error:" not in err.details()


def test_nothing_is_decoded_without_the_token(service):
    tcp, *_ = service
    with grpc.insecure_channel(tcp) as ch:
        raw = ch.unary_unary("/datastore.v1.DataStore/OpenSession", request_serializer=None,
                             response_deserializer=None)  # fmt: skip
        for metadata in (None, (("authorization", "Bearer nope"),)):
            with pytest.raises(grpc.RpcError) as err:
                raw(b"\xff\xff\xff\xff", timeout=10, metadata=metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_request_that_does_not_decode_is_invalid(service):
    _, _, _, sock = service
    with grpc.insecure_channel(f"unix://{sock}") as ch:
        raw = ch.unary_unary("/datastore.v1.DataStore/LoadDataset", request_serializer=None,
                             response_deserializer=None)  # fmt: skip
        with pytest.raises(grpc.RpcError) as err:
            raw(b"\xff\xff\xff\xff", timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_long_path_is_refused_at_once_without_echoing_it(service):
    _, _, _, sock = service
    long_path = "/a" * 150_000  # 300 KB, 150,000 components
    with grpc.insecure_channel(f"unix://{sock}") as ch:
        stub = pb_grpc.DataStoreStub(ch)
        t0 = time.monotonic()
        for request in (
            lambda: stub.LoadDataset(pb.LoadDatasetRequest(dataset_path=long_path), timeout=10),
            lambda: stub.OpenSession(
                pb.OpenSessionRequest(dataset_path=long_path, global_batch=1), timeout=10
            ),
        ):
            with pytest.raises(grpc.RpcError) as err:
                request()
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "longer than 4096 bytes" in err.value.details()
            assert len(err.value.details()) < 400
        assert time.monotonic() - t0 < 2
        with pytest.raises(grpc.RpcError) as err:
            stub.LoadDataset(pb.LoadDatasetRequest(dataset_path="/tmp/x\x00y"), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
