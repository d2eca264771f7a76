"""Shared-memory segments and sessions never outlive the service that made them."""

from __future__ import annotations

import os

import numpy as np
import pytest

from datastore.maths.delivery import delivered_fields
from datastore.readers.base import FieldInfo
from datastore.service._pb.v1 import datastore_pb2 as pb
from datastore.service.errors import ServiceError
from datastore.service.resident import Residency
from datastore.service.session import Sessions
from datastore.service.shm import PREFIX, Segment, remove_own, segment_dir
from datastore.service.stream import SlotRing


def _own(directory) -> list[str]:
    return sorted(p.name for p in directory.glob(f"{PREFIX}.{os.getuid()}.{os.getpid()}.*"))


class _Failing:
    """A gather whose copies fail, as one shut down under a stopping service would."""

    def run(self, copies) -> None:
        raise RuntimeError("cannot schedule new futures after shutdown")


def test_a_ring_whose_pages_cannot_be_faulted_in_leaves_no_segment():
    info = {"data": FieldInfo("data", np.dtype("float32"), (4, 8, 8, 8))}
    fields = delivered_fields(info, None, 0)
    before = _own(segment_dir())
    with pytest.raises(RuntimeError, match="after shutdown"):
        SlotRing(fields, batch_size=2, nslots=3, shared=True, gather=_Failing())
    assert _own(segment_dir()) == before


def test_remove_own_removes_this_process_segments_only(tmp_path):
    mine = [Segment(2, 4096, tmp_path) for _ in range(2)]
    other = tmp_path / f"{PREFIX}.{os.getuid()}.1.0123456789abcdef"  # pid 1 is alive
    other.write_bytes(b"")
    removed = remove_own(tmp_path)
    assert sorted(removed) == sorted(s.path for s in mine)
    assert [p.name for p in tmp_path.iterdir()] == [other.name]
    for s in mine:
        s.unmap()


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
