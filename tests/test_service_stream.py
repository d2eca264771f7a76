"""``datastore serve`` streaming batches (shared memory and inline): the same batches as the
embedded loader.

A real server subprocess on a Unix socket in ``tmp_path`` (started and killed as in
``test_service_basic``); the remote loader is
``DataStoreLoader(..., service=ServiceOptions(socket))``.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import grpc
import h5py
import numpy as np
import pytest

from datastore.loader import DataStoreLoader
from datastore.service._pb.v1 import datastore_pb2 as pb
from datastore.service._pb.v1 import datastore_pb2_grpc as pb_grpc
from datastore.service.client import (
    Client,
    RemoteBatches,
    open_channel,
    stream_batches,
    target_of,
)
from datastore.service.wire import plan_chunks
from datastore.sources.options import ExchangeOptions, ServiceOptions
from tests.test_service_basic import REPO, Server, wait_serving

SPATIAL = {"parts": (2, 1, 1), "halo": (1, 1, 1)}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``(dataset path, socket path, server)``: one server for the module, killed at the end."""
    tmp = tmp_path_factory.mktemp("stream")
    path = tmp / "data.h5"
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f["x"] = rng.standard_normal((24, 2, 8, 8, 8)).astype(np.float32)
        f["idx"] = np.arange(24, dtype=np.int64)
    runtime = tmp / "runtime"
    runtime.mkdir()
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime), "XDG_STATE_HOME": str(tmp / "state")}
    sock = tmp / "s.sock"
    s = Server(tmp / "logs", ["--socket", str(sock)], env)
    wait_serving(s.listening(30)[0], s.proc, timeout=30)
    yield path, sock, s
    if s.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(s.proc.pid, signal.SIGKILL)
    s.proc.wait(10)


def batches(loader, n=None):
    out = []
    for i, b in enumerate(loader):
        out.append({k: v.clone() for k, v in b.items()})
        if n is not None and i + 1 == n:
            break
    return out


def assert_same(a, b):
    assert len(a) == len(b) and len(a) > 0
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k].dtype == y[k].dtype and x[k].shape == y[k].shape
            assert x[k].numpy().tobytes() == y[k].numpy().tobytes()


@pytest.mark.parametrize(
    "kw",
    [{}, {"rank": 1, "world": 2, "spatial": SPATIAL}, {"rank": 1, "world": 4, "spatial": SPATIAL}],
    ids=["whole", "spatial-r1w2", "spatial-r1w4"],
)
@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_remote_equals_embedded_over_two_epochs(served, kw, transport):
    path, sock, _ = served
    local = DataStoreLoader(
        str(path), batch_size=4, seed=3, exchange=ExchangeOptions(enabled=False), **kw
    )
    remote = DataStoreLoader(
        str(path),
        batch_size=4,
        seed=3,
        service=ServiceOptions(str(sock), transport=transport),
        **kw,
    )
    assert remote.source == "service"
    try:
        assert len(remote) == len(local)
        for _ in range(2):
            assert_same(batches(remote), batches(local))
        assert remote.epoch == local.epoch == 2
        if kw.get("spatial"):
            assert remote.fields[0].name in ("x", "idx")
    finally:
        remote.close()
        local.close()


def test_inline_tensors_are_the_callers_to_write(served):
    """An inline tensor is a view of the message received for it alone: writing to it is
    allowed (no warning), and changes nothing else (later batches, the next epoch)."""
    path, sock, _ = served
    local = DataStoreLoader(
        str(path), batch_size=4, seed=3, exchange=ExchangeOptions(enabled=False)
    )
    remote = DataStoreLoader(
        str(path), batch_size=4, seed=3, service=ServiceOptions(str(sock), transport="inline")
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            kept = []
            for b in remote:
                for t in b.values():
                    assert t.is_contiguous()
                    t.fill_(7)  # the caller's to overwrite
                kept.append(b)
        assert all(bool((t == 7).all()) for b in kept for t in b.values())
        expected = batches(local)
        assert_same(batches(remote), batches(local))  # the next epoch is untouched
        assert len(kept) == len(expected)
    finally:
        remote.close()
        local.close()


def test_datastore_address_from_the_environment(served, monkeypatch):
    path, sock, _ = served
    local = batches(DataStoreLoader(str(path), batch_size=4, seed=3))
    monkeypatch.setenv("DATASTORE_ADDRESS", str(sock))
    remote = DataStoreLoader(str(path), batch_size=4, seed=3)
    assert remote.source == "service"
    try:
        assert_same(batches(remote), local)
    finally:
        remote.close()
    monkeypatch.setenv("DATASTORE_ADDRESS", "")
    assert DataStoreLoader(str(path), batch_size=4).source == "local"


def test_resume_mid_epoch_equals_uninterrupted(served):
    path, sock, _ = served
    with DataStoreLoader(
        str(path), batch_size=4, seed=3, service=ServiceOptions(str(sock))
    ) as whole:
        whole.set_epoch(1)
        expected = batches(whole)
    with DataStoreLoader(
        str(path), batch_size=4, seed=3, service=ServiceOptions(str(sock))
    ) as first:
        first.set_epoch(1)
        head = batches(first, 2)
        saved = first.state_dict()
    assert saved["epoch"] == 1 and saved["step"] == 2
    with DataStoreLoader(
        str(path), batch_size=4, seed=3, service=ServiceOptions(str(sock))
    ) as second:
        second.load_state_dict(saved)
        tail = batches(second)
    assert_same(head + tail, expected)
    with DataStoreLoader(
        str(path), batch_size=4, seed=3, service=ServiceOptions(str(sock))
    ) as whole:
        whole.set_epoch(2)
        after = batches(whole)
    with DataStoreLoader(
        str(path), batch_size=4, seed=3, service=ServiceOptions(str(sock))
    ) as same:
        same.set_epoch(1)
        head = batches(same, 3)  # breaking out cancels the call; a new iter() is a new pass
        t0 = time.monotonic()
        assert_same(head, expected[:3])
        assert_same(batches(same), after)
        assert time.monotonic() - t0 < 10


def test_resume_over_the_service_refuses_other_data_of_the_same_size(served):
    """The service says which files it serves: a state resumes embedded or served alike over
    them, and is refused over a file of the same size holding other samples."""
    path, sock, _ = served
    other = path.with_name("other.h5")
    shutil.copy(path, other)
    with h5py.File(other, "r+") as f:
        f["idx"][...] = f["idx"][...][::-1]
    service = ServiceOptions(str(sock))
    with DataStoreLoader(str(path), batch_size=4, seed=3, service=service) as served_loader:
        saved = served_loader.state_dict()
    embedded = DataStoreLoader(str(path), batch_size=4, seed=3)
    assert saved["dataset"]["identity"] == embedded.state_dict()["dataset"]["identity"]
    embedded.load_state_dict(saved)
    loader = DataStoreLoader(str(other), batch_size=4, seed=3, service=service)
    with loader, pytest.raises(ValueError, match=r"saved over '.*data\.h5' \(files \w+\), this"):
        loader.load_state_dict(saved)


def test_the_next_epoch_is_filled_while_the_consumer_finishes_this_one(served):
    """Over shared memory an epoch's last batch asks for the next epoch's first ``prefetch``
    batches: the service has filled them before the next pass begins. A pass that starts
    elsewhere cancels them; every pass gives the embedded loader's batches."""
    path, sock, _ = served
    kw = {"batch_size": 4, "seed": 1, "prefetch": 2}
    remote = DataStoreLoader(str(path), service=ServiceOptions(str(sock), transport="shm"), **kw)
    local = DataStoreLoader(str(path), exchange=ExchangeOptions(enabled=False), **kw)

    def served_so_far() -> int:
        with Client(sock) as c:
            mine = [x for x in c.status().sessions if x.session_id == remote.session_id]
        return mine[0].batches_served

    try:
        assert_same(batches(remote), batches(local))  # epoch 0: 6 steps
        deadline = time.monotonic() + 20
        while served_so_far() < 6 + 2:
            assert time.monotonic() < deadline, f"served {served_so_far()}: none ahead"
            time.sleep(0.05)
        assert served_so_far() == 6 + 2  # prefetch batches ahead, no more
        for epoch in (1, 5, 6):  # 5: not the epoch asked for ahead (2 was)
            remote.set_epoch(epoch)
            local.set_epoch(epoch)
            assert_same(batches(remote), batches(local))
    finally:
        remote.close()
        local.close()


def test_a_newer_stream_of_a_rank_takes_over_its_shared_memory_slots(served):
    """A rank's stream left open unread (a pass given up before its cancel lands) never keeps
    the slots from the rank's next stream: that one streams its whole epoch, the older one
    ends with ABORTED, lending no more regions."""
    path, sock, _ = served
    with grpc.insecure_channel(target_of(sock)) as ch:
        ds = pb_grpc.DataStoreStub(ch)
        opened = pb.OpenSessionRequest(dataset_path=str(path), global_batch=2)
        sid = ds.OpenSession(opened, timeout=10).session_id
        shm = {"session_id": sid, "transport": pb.TRANSPORT_SHARED_MEMORY, "prefetch": 1}
        old = ds.StreamBatches(iter([pb.StreamBatchesRequest(**shm)]), timeout=30)
        kept = next(old).tensors[0].shm.generation  # 4 slots; the rest it fills, never read
        requests: queue.SimpleQueue = queue.SimpleQueue()
        requests.put(pb.StreamBatchesRequest(**shm, epoch=1, held=[kept]))
        newer = ds.StreamBatches(iter(requests.get, None), timeout=20)
        steps = []
        with contextlib.suppress(grpc.RpcError):  # the steps tell (DEADLINE_EXCEEDED: stuck)
            for b in newer:
                steps.append(b.step)
                requests.put(pb.StreamBatchesRequest(done=[b.tensors[0].shm.generation]))
        requests.put(None)
        assert steps == list(range(12)), "the newer stream got stuck for want of slots"
        with pytest.raises(grpc.RpcError) as err:
            list(old)
        assert err.value.code() == grpc.StatusCode.ABORTED
        assert "a newer stream of rank 0 took over" in err.value.details()
        ds.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)


def test_a_shared_memory_slot_is_in_memory_before_its_first_batch_and_only_it(served):
    """The service puts a slot's pages in place before it first fills it (faulting fresh
    shared memory in page by page made each slot's first batch many times slower than the
    next), and only that slot's: the whole segment at once delayed the stream's first batch."""
    path, sock, _ = served
    with grpc.insecure_channel(target_of(sock)) as ch:
        ds = pb_grpc.DataStoreStub(ch)
        opened = pb.OpenSessionRequest(dataset_path=str(path), global_batch=2)
        sid = ds.OpenSession(opened, timeout=10).session_id
        first = pb.StreamBatchesRequest(
            session_id=sid, transport=pb.TRANSPORT_SHARED_MEMORY, prefetch=1, max_batches=1
        )
        call = ds.StreamBatches(iter([first]), timeout=30)
        batch = next(call)  # filled one of its 4 slots
        segment = os.stat(batch.tensors[0].shm.path)  # never mapped: the file is still there
        call.cancel()
        slot = -(-2 * (2 * 8 * 8 * 8 * 4 + 8) // 4096) * 4096
        assert segment.st_size == 4 * slot
        placed = segment.st_blocks * 512
        assert slot <= placed < 4 * slot, f"{placed} bytes in place: one slot's, not all 4"
        ds.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)


def test_refusals_and_the_server_keeps_serving(served, tmp_path):
    path, sock, s = served
    with grpc.insecure_channel(target_of(sock)) as ch:
        ds = pb_grpc.DataStoreStub(ch)

        def code(fn):
            with pytest.raises(grpc.RpcError) as err:
                fn()
            return err.value.code()

        open_ = ds.OpenSession
        missing = pb.OpenSessionRequest(dataset_path=str(tmp_path / "none.h5"), global_batch=4)
        assert code(lambda: open_(missing, timeout=10)) == grpc.StatusCode.NOT_FOUND
        zero = pb.OpenSessionRequest(dataset_path=str(path), global_batch=0)
        assert code(lambda: open_(zero, timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT
        huge = pb.OpenSessionRequest(dataset_path=str(path), global_batch=10**7)
        assert code(lambda: open_(huge, timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT
        odd = pb.OpenSessionRequest(
            dataset_path=str(path),
            global_batch=4,
            world_size=3,
            spatial=pb.SpatialLayout(parts=[2, 1, 1]),
        )
        assert code(lambda: open_(odd, timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT
        sideways = pb.OpenSessionRequest(
            dataset_path=str(path), global_batch=4, shuffle_mode="sideways"
        )
        assert code(lambda: open_(sideways, timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT
        ok = open_(pb.OpenSessionRequest(dataset_path=str(path), global_batch=4), timeout=10)
        assert ok.num_samples == 24 and ok.steps_per_epoch == 6 and ok.shuffle == "none"
        assert {f.name for f in ok.fields} == {"x", "idx"}
        bad_rank = pb.StreamBatchesRequest(session_id=ok.session_id, rank=1)
        got = code(lambda: list(ds.StreamBatches(iter([bad_rank]), timeout=10)))
        assert got == grpc.StatusCode.INVALID_ARGUMENT
        first = list(
            ds.StreamBatches(
                iter(
                    [pb.StreamBatchesRequest(session_id=ok.session_id, max_batches=2, transport=1)]
                ),
                timeout=10,
            )
        )
        assert [b.step for b in first] == [0, 1]
        ds.CloseSession(pb.CloseSessionRequest(session_id=ok.session_id), timeout=10)
        close = pb.CloseSessionRequest(session_id=ok.session_id)
        assert code(lambda: ds.CloseSession(close, timeout=10)) == grpc.StatusCode.NOT_FOUND
        nosession = pb.StreamBatchesRequest(session_id="nope")
        got = code(lambda: list(ds.StreamBatches(iter([nosession]), timeout=10)))
        assert got == grpc.StatusCode.NOT_FOUND
    with pytest.raises(ValueError, match="batch_size"):  # refused here, as embedded
        DataStoreLoader(str(path), batch_size=-1, service=ServiceOptions(str(sock)))
    with DataStoreLoader(str(path), batch_size=4, seed=3, service=ServiceOptions(str(sock))) as r:
        assert len(batches(r)) == 6
    assert s.proc.poll() is None


def test_client_killed_mid_stream_leaves_server_healthy(served):
    path, sock, s = served
    script = textwrap.dedent(
        f"""
        import sys, time
        from datastore import DataStoreLoader, ServiceOptions
        service = ServiceOptions({str(sock)!r})
        r = DataStoreLoader({str(path)!r}, batch_size=4, seed=3, service=service)
        for i, b in enumerate(r):
            print("got", i, flush=True)
            time.sleep(60)
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().startswith("got 0")
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
    time.sleep(0.2)
    assert s.proc.poll() is None
    with DataStoreLoader(str(path), batch_size=4, seed=3, service=ServiceOptions(str(sock))) as r:
        got = batches(r)
    local = DataStoreLoader(
        str(path), batch_size=4, seed=3, exchange=ExchangeOptions(enabled=False)
    )
    try:
        assert_same(got, batches(local))
    finally:
        local.close()
    assert s.proc.poll() is None


def test_socket_path_target():
    assert target_of("/tmp/x.sock") == "unix:///tmp/x.sock"
    assert target_of(Path("/tmp/x.sock")) == "unix:///tmp/x.sock"
    assert target_of("127.0.0.1:5") == "127.0.0.1:5"


@pytest.fixture(scope="module", params=[5000, 3000], ids=["samples-fit", "samples-cut"])
def chunking(request, served, tmp_path_factory):
    """``(dataset path, socket path, chunk size)``: a server whose inline chunk size is forced
    small (256 MiB is gRPC's cap; 64 MiB the default chunk): a batch of 4 (16 KiB of ``x``)
    comes in several messages; at 5000 bytes whole samples fit a chunk, at 3000 each sample of
    ``x`` (4 KiB) is cut in two."""
    path, _, _ = served
    tmp = tmp_path_factory.mktemp(f"chunk{request.param}")
    runtime = tmp / "runtime"
    runtime.mkdir()
    env = {
        **os.environ,
        "XDG_RUNTIME_DIR": str(runtime),
        "XDG_STATE_HOME": str(tmp / "state"),
        "DATASTORE_INLINE_CHUNK": str(request.param),
    }
    sock = tmp / "c.sock"
    s = Server(tmp / "logs", ["--socket", str(sock)], env)
    wait_serving(s.listening(30)[0], s.proc, timeout=30)
    yield path, sock, request.param
    s.proc.send_signal(signal.SIGTERM)
    s.proc.wait(10)


@pytest.mark.parametrize("kw", [{}, {"rank": 1, "world": 2, "spatial": SPATIAL}])
def test_inline_batches_over_the_chunk_size_come_in_chunks(chunking, kw):
    """A batch larger than one message arrives in several, reassembled into arrays the loader
    owns: the same bytes as the embedded loader's, epoch after epoch."""
    path, sock, _ = chunking
    local = DataStoreLoader(
        str(path), batch_size=4, seed=3, exchange=ExchangeOptions(enabled=False), **kw
    )
    with DataStoreLoader(
        str(path), batch_size=4, seed=3, service=ServiceOptions(str(sock), transport="inline"), **kw
    ) as remote:
        for _ in range(2):
            got = batches(remote)
            assert_same(got, batches(local))
        with Client(sock) as c:
            (session,) = c.status().sessions
        assert session.batches_served == 2 * len(local)  # batches, not messages
    local.close()


def open_inline(sock, path, fields=()):
    """A channel, a session (batch 4, one rank, seed 3) and an inline stream request."""
    channel = open_channel(target_of(sock))
    reply = pb_grpc.DataStoreStub(channel).OpenSession(
        pb.OpenSessionRequest(
            dataset_path=str(path),
            seed=3,
            global_batch=4,
            world_size=1,
            shuffle=True,
            drop_last=True,
            fields=list(fields),
        ),
        timeout=30,
    )
    request = pb.StreamBatchesRequest(
        session_id=reply.session_id, rank=0, epoch=0, transport=pb.TRANSPORT_INLINE
    )
    return channel, reply, request


def test_the_service_sends_no_chunk_over_its_size(chunking):
    """On the wire: each batch is a first message with the header and the tensors' metadata,
    then chunks in order, none over the chunk size, whole samples a chunk where they fit."""
    path, sock, limit = chunking
    channel, reply, request = open_inline(sock, path)
    try:
        messages = list(stream_batches(channel)(iter([request]), timeout=30))
    finally:
        channel.close()
    metas = [t.meta for t in messages[0].tensors]
    rows = [(int(m.shape[0]), int(m.nbytes) // int(m.shape[0])) for m in metas]
    plan = plan_chunks(rows, limit)
    per_batch = len(plan)
    assert per_batch > 1 and len(messages) == per_batch * reply.steps_per_epoch
    total = sum(m.nbytes for m in metas)
    for i, b in enumerate(messages):
        step, k = divmod(i, per_batch)
        assert b.header.step == step and b.header.chunk_total == total
        assert len(b.chunk) <= limit and all(t.data is None for t in b.tensors)
        assert bool(b.tensors) == (k == 0) == (b.header.chunk_offset == 0)
    assert [len(b.chunk) for b in messages[:per_batch]] == [
        sum(p.stop - p.start for p in chunk) for chunk in plan
    ]
    whole = all(p.stop - p.start == rows[p.tensor][1] for chunk in plan for p in chunk)
    assert whole == (limit >= 4096)  # a sample of x (4 KiB) is cut only when it must be


def test_remote_batches_views_are_read_only_and_reassembled_arrays_owned(chunking):
    """``RemoteBatches`` yields a batch that came in one message as read-only views of it (its
    bytes are never written), and one that came in chunks as fresh arrays the caller owns;
    both with the batch's header, and the embedded loader's bytes."""
    path, sock, _ = chunking
    local = DataStoreLoader(
        str(path), batch_size=4, seed=3, exchange=ExchangeOptions(enabled=False)
    )
    expected = batches(local)
    local.close()
    for fields in (["idx"], []):  # 32 bytes a batch: one message; 16 KiB: chunks
        channel, reply, request = open_inline(sock, path, fields)
        try:
            got = list(RemoteBatches(stream_batches(channel), request))
        finally:
            channel.close()
        assert len(got) == reply.steps_per_epoch == len(expected)
        for step, (r, want) in enumerate(zip(got, expected, strict=True)):
            h = r.header
            assert (h.step, h.epoch, h.last_in_epoch) == (step, 0, step == len(expected) - 1)
            assert r.arrays["idx"].tolist() == list(h.sample_indices)  # idx[i] = i
            assert r.generation is None and r.arrays.keys() == set(fields or want)
            for name, a in r.arrays.items():
                assert a.tobytes() == want[name].numpy().tobytes()
                if fields:
                    assert not r.owned and a.flags.writeable is False
                    with pytest.raises(ValueError, match="read-only"):
                        a[...] = 0
                else:
                    assert r.owned and a.flags.writeable and a.flags.owndata


@pytest.mark.parametrize(
    "name, value",
    [("DATASTORE_INLINE_CHUNK", "lots"), ("DATASTORE_SHM_DIR", "/nonexistent/shm")],
)
def test_a_bad_setting_in_the_environment_stops_the_service_at_start(tmp_path, name, value):
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path), name: value}
    s = Server(tmp_path / "logs", ["--socket", str(tmp_path / "x.sock")], env)
    assert s.proc.wait(30) == 2
    assert name in s.stderr and value in s.stderr


@pytest.mark.filterwarnings("ignore:datastore. 2 ranks")
def test_a_rank_whose_stream_fails_fails_its_jobs_other_ranks_streams(tmp_path):
    """Rank 1's stream failed ``DATA_LOSS`` (a sample file truncated, on disk under the memory
    budget) while rank 0 of the same job streamed on and finished its epoch (to hang in its
    next collective); now rank 0's open stream and its later ones end ``ABORTED`` naming rank
    1 and the cause."""
    from datastore.errors import DataStoreError
    from tests.helpers import serving

    d = tmp_path / "d"
    d.mkdir()
    for i in range(72):  # 128 KiB each: 56 in memory, the rest read from disk at each use
        np.save(d / f"s{i:03d}.npy", np.full((4, 8192), i, np.float32))
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    with serving(tmp_path, env, "--memory-budget", "8M", log=tmp_path / "log") as sock:
        with Client(sock) as c:  # (read in before its files are cut)
            assert c.load(str(d), wait=True).dataset.bytes_resident == 56 * 4 * 8192 * 4
        kw = {"batch_size": 1, "world": 2, "seed": 3, "timeout": 10, "prefetch": 1}
        ranks = [
            DataStoreLoader(str(d), rank=r, **kw, service=ServiceOptions(str(sock), job_id="j"))
            for r in range(2)
        ]
        try:
            zero = iter(ranks[0])
            assert next(zero)["data"].shape == (1, 4, 8192)  # rank 0's stream is open
            ones = [int(i) for s in range(36) for i in ranks[1].schedule.rank_samples(0, s, 1, 2)]
            assert max(ones) >= 56
            for i in ones:  # (those in memory are served; the first on disk fails)
                (d / f"s{i:03d}.npy").write_bytes(b"\x93NUMPY")
            with pytest.raises(DataStoreError) as failed:
                for _ in ranks[1]:
                    pass
            assert failed.value.grpc_status == grpc.StatusCode.DATA_LOSS
            why = f"rank 1 of job 'j' failed on node 0: DATA_LOSS: {failed.value.grpc_details}"
            got = 1
            with pytest.raises(DataStoreError) as aborted:
                for _ in zero:
                    got += 1
            assert got < 36, got  # (rank 0's epoch: 36 batches; its slots in shared memory)
            assert "streaming_inline" not in (tmp_path / "log").read_text()
            assert aborted.value.grpc_status == grpc.StatusCode.ABORTED
            assert aborted.value.grpc_details.endswith(why), aborted.value.grpc_details
            with pytest.raises(DataStoreError) as again:  # its next pass too
                next(iter(ranks[0]))
            assert (again.value.grpc_status, again.value.grpc_details) == (
                grpc.StatusCode.ABORTED,
                why,
            )
        finally:
            for loader in ranks:
                loader.close()
