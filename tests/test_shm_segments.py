"""Shared-memory segments and sessions never outlive the service that made them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from datastore.errors import DataStoreError
from datastore.maths.delivery import delivered_fields
from datastore.readers.base import FieldInfo
from datastore.service._pb.v1 import datastore_pb2 as pb
from datastore.service.errors import ServiceError
from datastore.service.resident import Residency
from datastore.service.session import Sessions
from datastore.service.shm import (
    PREFIX,
    ClientMaps,
    Segment,
    disk_backed,
    filesystem_of,
    reclaim_stale,
    remove_own,
    segment_dir,
)
from datastore.service.stream import SlotRing
from datastore.store.gather import Gather


def _own(directory) -> list[str]:
    return sorted(p.name for p in directory.glob(f"{PREFIX}.{os.getuid()}.{os.getpid()}.*"))


class _Failing:
    """A gather whose copies fail, as one shut down under a stopping service would."""

    def run(self, copies) -> None:
        raise RuntimeError("cannot schedule new futures after shutdown")


def test_a_slot_whose_pages_cannot_be_faulted_in_stays_free_and_no_segment_is_left():
    info = {"data": FieldInfo("data", np.dtype("float32"), (4, 8, 8, 8))}
    fields = delivered_fields(info, None, 0)
    before = _own(segment_dir())
    ring = SlotRing(fields, batch_size=2, nslots=3, shared=True, gather=_Failing())
    with pytest.raises(RuntimeError, match="after shutdown"):
        ring.take(threading.Event())
    with pytest.raises(RuntimeError, match="after shutdown"):  # put back, still to fault in
        ring.poll()
    ring.close()
    assert _own(segment_dir()) == before


class _Counted(Gather):
    """A real gather that records the bytes of each run."""

    def __init__(self) -> None:
        super().__init__(2)
        self.runs: list[int] = []

    def run(self, copies) -> None:
        self.runs.append(sum(d.nbytes for d, _ in copies))
        super().run(copies)


def test_a_slot_is_faulted_in_with_zeros_on_first_use_only():
    """A stream's first batch waits for its own slot's pages, not the whole segment's; a slot
    taken again keeps what was written (no second fault-in over a batch)."""
    info = {"data": FieldInfo("data", np.dtype("float32"), (4, 8, 8, 8))}
    fields = delivered_fields(info, None, 0)
    gather = _Counted()
    ring = SlotRing(fields, batch_size=2, nslots=3, shared=True, gather=gather)
    slot_bytes = ring.segment.slot_bytes
    stop = threading.Event()
    assert gather.runs == []  # nothing at construction
    first = ring.take(stop)
    assert gather.runs == [slot_bytes] and not ring.slots[first]["data"].any()
    ring.slots[first]["data"][:] = 7
    ring.give(first)
    taken = [ring.take(stop) for _ in range(3)]  # the others, then the first again
    assert sorted(taken) == [0, 1, 2] and gather.runs == [slot_bytes] * 3
    assert (ring.slots[first]["data"] == 7).all()  # not zeroed again
    ring.close()
    gather.close()


def test_remove_own_removes_this_process_segments_only(tmp_path):
    mine = [Segment(2, 4096, tmp_path) for _ in range(2)]
    other = tmp_path / f"{PREFIX}.{os.getuid()}.1.0123456789abcdef"  # pid 1 is alive
    other.write_bytes(b"")
    removed = remove_own(tmp_path)
    assert sorted(removed) == sorted(s.path for s in mine)
    assert [p.name for p in tmp_path.iterdir()] == [other.name]
    for s in mine:
        s.unmap()


def test_another_users_files_named_as_segments_are_left_alone(tmp_path, monkeypatch):
    """Another user could name a file in /dev/shm as a dead service's segment, or as the live
    one's: unlinking it failed (the sticky bit), and serve exited at start or at its stop with
    'internal error: PermissionError'. Here the files are this process's, the service another
    uid's."""
    uid = os.getuid() + 1
    monkeypatch.setattr(os, "getuid", lambda: uid)
    planted = [
        tmp_path / f"{PREFIX}.{uid}.999999999.x",
        tmp_path / f"{PREFIX}.{uid}.{os.getpid()}.x",
    ]
    for p in planted:
        p.write_bytes(b"")
    assert (reclaim_stale(tmp_path), remove_own(tmp_path)) == ([], [])
    assert sorted(tmp_path.iterdir()) == sorted(planted)


def test_an_inline_stream_over_the_whole_memory_budget_is_refused(tmp_path):
    """Inline batches are not counted in the budget: a batch of 2,048 samples of 1 MiB took
    the service from 211 MiB to 4 GiB under --memory-budget 128K (1,000,000: all memory)."""
    for i in range(4):
        np.save(tmp_path / f"s{i}.npy", np.full((2, 4), i, np.float32))
    residency = Residency(1 << 20, None)
    sessions = Sessions(residency)
    request = pb.OpenSessionRequest(dataset_path=str(tmp_path), global_batch=1_000_000)
    session = sessions.open(request)
    with pytest.raises(ServiceError) as err:
        session.stream(pb.StreamBatchesRequest(session_id=session.session_id), False)
    assert (err.value.code, str(err.value)) == (
        "RESOURCE_EXHAUSTED",
        "an inline stream's 3 batches of 32000000 bytes exceed the memory budget of 1048576 "
        "bytes: ask for smaller batches or less prefetch",
    )
    sessions.close_all()
    residency.close()


def test_inline_streams_together_are_refused_over_the_memory_budget(tmp_path):
    """Each inline stream was checked alone: eight streams of 40 MiB under --memory-budget
    64M took the service from 137 MiB to 594 MiB."""
    for i in range(4):
        np.save(tmp_path / f"s{i}.npy", np.full((2, 4), i, np.float32))
    residency = Residency(1 << 20, None)
    sessions = Sessions(residency)

    def stream() -> tuple:  # a session of one rank, 3 inline batches of 4,000 samples
        session = sessions.open(
            pb.OpenSessionRequest(dataset_path=str(tmp_path), global_batch=4000)
        )
        return session, session.stream(
            pb.StreamBatchesRequest(session_id=session.session_id), False
        )

    (first, _), _ = stream(), stream()
    assert residency.inline_bytes == 2 * 384_000
    with pytest.raises(ServiceError) as err:
        stream()
    assert (err.value.code, str(err.value)) == (
        "RESOURCE_EXHAUSTED",
        "an inline stream's 3 batches of 128000 bytes beside 768000 bytes of other inline "
        "streams exceed the memory budget of 1048576 bytes: ask for smaller batches or less "
        "prefetch",
    )
    sessions.close(first.session_id)
    stream()  # the closed session's room is free again
    assert residency.inline_bytes == 2 * 384_000
    sessions.close_all()
    assert residency.inline_bytes == 0
    residency.close()


def test_an_inline_streams_budget_goes_back_at_its_end_not_its_sessions(tmp_path):
    """Two clients, one inline stream each under a budget with room for one: the first
    streamed a batch and stopped, keeping its session; its 192 bytes stayed counted until the
    session closed, and the second's stream was refused ``RESOURCE_EXHAUSTED``. A stream
    still open keeps its room; the first's next stream counts again."""
    for i in range(4):
        np.save(tmp_path / f"s{i}.npy", np.full((2, 4), i, np.float32))
    residency = Residency(300, None)
    sessions = Sessions(residency)
    request = pb.OpenSessionRequest(dataset_path=str(tmp_path), global_batch=2)
    a, b = sessions.open(request), sessions.open(request)
    busy = "an inline stream's 3 batches of 64 bytes beside 192 bytes of other inline streams"

    def stream(session):  # 3 inline batches of 2 samples: 192 bytes
        return session.stream(pb.StreamBatchesRequest(session_id=session.session_id), False)

    first = stream(a)
    messages = first.messages()
    assert next(messages)[1] == 64
    with pytest.raises(ServiceError, match=busy):
        stream(b)
    messages.close()
    a.release(first)  # the servicer's, as the stream ends (and once more from its callback)
    a.release(first)
    assert residency.inline_bytes == 0
    second = stream(b)
    assert residency.inline_bytes == 192
    with pytest.raises(ServiceError, match=busy):
        stream(a)
    b.release(second)
    third = stream(a)
    a.release(first)  # an old stream's release leaves the rank's new ring alone
    assert residency.inline_bytes == 192 and a.rings == {(0, False): third.ring}
    sessions.close_all()
    assert residency.inline_bytes == 0
    residency.close()


def test_an_inline_stream_over_the_memory_available_is_refused_without_a_budget(
    tmp_path, monkeypatch
):
    """With no budget, 1,000,000 samples of 1 MiB took the service to 14 GiB, and every call
    waited, until it was killed."""
    monkeypatch.setenv("DATASTORE_MEMORY_AVAILABLE", "1M")
    for i in range(4):
        np.save(tmp_path / f"s{i}.npy", np.full((2, 4), i, np.float32))
    residency = Residency(None, None)
    sessions = Sessions(residency)
    for batch, refused in ((10_000, False), (100_000, True)):
        request = pb.OpenSessionRequest(dataset_path=str(tmp_path), global_batch=batch)
        session = sessions.open(request)
        stream = pb.StreamBatchesRequest(session_id=session.session_id)
        if refused:
            with pytest.raises(ServiceError, match="exceed the memory available of 1048576 b"):
                session.stream(stream, False)
        else:
            session.stream(stream, False).close()
    sessions.close_all()
    residency.close()


def test_a_session_made_while_the_service_stops_is_refused_and_closed(tmp_path):
    """close_all() ran between a session's making and its listing: nobody would close it."""
    for i in range(4):
        np.save(tmp_path / f"s{i}.npy", np.full((2, 4), i, np.float32))
    residency = Residency(1 << 20, None)
    sessions = Sessions(residency)
    sessions.close_all()
    with pytest.raises(ServiceError) as err:
        sessions.open(pb.OpenSessionRequest(dataset_path=str(tmp_path), global_batch=2))
    assert (err.value.code, str(err.value)) == ("UNAVAILABLE", "the service is stopping")
    assert sessions.all() == [] and [r.sessions for r in residency.all()] == [0]
    residency.close()


def test_a_ring_says_when_the_client_holds_every_slot():
    """A stream's wait while the client reads every slot is the client's, not a stall of the
    service's (a consumer slower than the service was reported as stalled)."""
    info = {"data": FieldInfo("data", np.dtype("float32"), (4,))}
    ring = SlotRing(delivered_fields(info, None, 0), batch_size=2, nslots=2, shared=False)
    stop = threading.Event()
    ring.keep_only([], stream="s")
    generations = [ring.lend(ring.take(stop), "s") for _ in range(2)]
    assert ring.client_holds_all()
    ring.done(generations[:1])
    assert not ring.client_holds_all()


def test_a_relative_shm_dir_names_segments_by_absolute_paths(tmp_path, monkeypatch):
    """``DATASTORE_SHM_DIR=segs``: segments were sent as ``segs/datastore...``, which a client
    in another directory could not open (FileNotFoundError on the first batch)."""
    (tmp_path / "svc" / "segs").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "svc")
    monkeypatch.setenv("DATASTORE_SHM_DIR", "segs")
    assert segment_dir() == tmp_path / "svc" / "segs"
    seg = Segment(1, 4096)
    monkeypatch.chdir(tmp_path)  # a client elsewhere opens what it was sent
    assert seg.path.parent == tmp_path / "svc" / "segs" and os.path.getsize(seg.path) == 4096
    seg.close()
    seg.unmap()


def test_a_shm_dir_removed_while_serving_refuses_the_stream_by_name(tmp_path, monkeypatch):
    """``DATASTORE_SHM_DIR`` removed under a running service: a shared-memory stream is
    ``UNAVAILABLE`` naming it, and stopping finds nothing to remove (the stream was an
    internal error, and the stopping service exited 1 with one)."""
    (tmp_path / "data").mkdir()
    for i in range(4):
        np.save(tmp_path / "data" / f"s{i}.npy", np.full((2, 4), i, np.float32))
    monkeypatch.setenv("DATASTORE_SHM_DIR", str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    residency = Residency(1 << 20, None)
    sessions = Sessions(residency)
    s = sessions.open(pb.OpenSessionRequest(dataset_path=str(tmp_path / "data"), global_batch=2))
    (tmp_path / "shm").rmdir()
    with pytest.raises(ServiceError) as err:
        s.stream(pb.StreamBatchesRequest(session_id=s.session_id), True)
    assert err.value.code == "UNAVAILABLE"
    assert str(err.value) == (
        f"no shared-memory segment for the stream: DATASTORE_SHM_DIR={tmp_path / 'shm'}: "
        "not a directory this user can write"
    )
    assert s.rings == {} and residency.ring_bytes == 0  # no ring kept, none budgeted
    assert remove_own() == []
    sessions.close_all()
    residency.close()


FULL_TMPFS = """
import threading, numpy as np
from datastore.errors import DataStoreError
from datastore.maths.delivery import delivered_fields
from datastore.readers.base import FieldInfo
from datastore.service.errors import ServiceError
from datastore.service.stream import SlotRing
info = {"x": FieldInfo("x", np.dtype("float32"), (32, 32, 32))}  # 128 KiB
ring = SlotRing(delivered_fields(info, None, 0), batch_size=4, nslots=6, shared=True)
taken = []
try:
    while True:
        taken.append(ring.take(threading.Event()))
except ServiceError as exc:
    print(len(taken), exc.code, exc)
ring.close()
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare"), reason="a tmpfs of its own needs root"
)
def test_a_shm_dir_too_small_for_a_ring_refuses_the_slot_not_kills_the_service(tmp_path):
    """A ring larger than ``DATASTORE_SHM_DIR``'s tmpfs (a container's 64 MiB ``/dev/shm``):
    the slot that finds no room is ``RESOURCE_EXHAUSTED`` naming the directory; writing zeros
    into its pages killed the service with ``SIGBUS`` (exit -7), every job on the node with
    it. Here a 1 MiB tmpfs and slots of 512 KiB: two fit."""
    shm = tmp_path / "shm"
    shm.mkdir()
    script = f"mount -t tmpfs -o size=1m tmpfs {shm} && exec {sys.executable} -c '{FULL_TMPFS}'"
    env = {**os.environ, "DATASTORE_SHM_DIR": str(shm)}
    r = subprocess.run(["unshare", "--mount", "sh", "-c", script], env=env,
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert (r.returncode, r.stdout) == (0, (
        f"2 RESOURCE_EXHAUSTED no room for a shared-memory slot of 524288 bytes in {shm} "
        "(DATASTORE_SHM_DIR names a larger one)\n"
    )), r.stderr  # fmt: skip


def test_a_segment_this_process_cannot_see_is_named_with_the_way_out(tmp_path):
    """A client that does not see the service's segment directory (a container sharing only
    the socket) was told a bare ``FileNotFoundError``."""
    with pytest.raises(DataStoreError) as err:
        ClientMaps().array(str(tmp_path / "datastore.0.1.x"), 0, np.dtype(np.float32), (2,))
    assert str(err.value) == (
        f"cannot map the service's shared memory {tmp_path / 'datastore.0.1.x'} (No such file "
        "or directory): this process must see the directory the service writes its segments "
        "to (/dev/shm, or its DATASTORE_SHM_DIR), or stream inline "
        '(ServiceOptions(transport="inline"))'
    )


def test_segments_on_a_disk_are_told_apart_from_memory():
    """``DATASTORE_SHM_DIR`` on a disk's file system was taken without a word: every batch
    written went to the disk too."""
    assert filesystem_of(Path("/proc/self")) == "proc"
    assert disk_backed(Path("/proc")) == (
        "shared-memory segments in /proc lie on proc, not in memory (tmpfs): batches are "
        "written back to its disk; point DATASTORE_SHM_DIR at a tmpfs"
    )
    if filesystem_of(Path("/dev/shm")) != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm here")
    assert disk_backed(Path("/dev/shm")) is None
