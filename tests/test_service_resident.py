"""The resident datasets of ``datastore serve`` (``Residency``), in this process: what the
service's calls share under one lock."""

from __future__ import annotations

import io
import json
import os
import threading
import time

import h5py
import numpy as np
import pytest

from datastore.readers.base import DatasetError
from datastore.service import resident
from datastore.service.config import ServeConfig
from datastore.service.errors import ServiceError
from datastore.service.logs import JsonLog
from datastore.service.resident import Residency
from datastore.service.servicer import Counters, Servicer, Stop
from staging.confine import beneath, opened_path

SAMPLES = 16
SAMPLE_BYTES = 4 * 4 * 4 * 4  # "x" (4, 4, 4) float32


def make_dataset(path, seed):
    with h5py.File(path, "w") as f:
        f["x"] = np.random.default_rng(seed).standard_normal((SAMPLES, 4, 4, 4), np.float32)
    return str(path)


def test_evicting_a_loading_dataset_holds_no_lock_while_its_reads_finish(tmp_path, monkeypatch):
    """Dataset a is still loading, its read in flight held up (on a slow disk, a large sample),
    when dataset b's load evicts it (a budget with room for one). Closing a waits for that read;
    it happens outside the lock that every call takes (Status's ``all()`` answers at once, and
    b's load returns), in b's loader, before b reads anything: a's memory goes before b's
    comes. Once the read ends, a is closed and b loads whole."""
    a, b = make_dataset(tmp_path / "a.h5", 1), make_dataset(tmp_path / "b.h5", 2)
    gate, reading = threading.Event(), threading.Event()
    open_reader = resident._reader

    def held_up(path, roots=()):
        reader = open_reader(path, roots)
        if path == a:
            read = reader.read

            def slow_read(*args, **kw):
                reading.set()
                assert gate.wait(30)
                return read(*args, **kw)

            reader.read = slow_read
        return reader

    monkeypatch.setattr(resident, "_reader", held_up)
    residency = Residency(budget=SAMPLES * SAMPLE_BYTES * 3 // 2, threads=1)

    def listed() -> list[str] | None:
        """The resident paths, or ``None`` when the lock is not had within 2 s."""
        out: list[list[str]] = []
        t = threading.Thread(target=lambda: out.append([r.path for r in residency.all()]))
        t.start()
        t.join(2)
        return out[0] if out else None

    try:
        ra = residency.load(a)
        assert reading.wait(10)  # a's loader is in its first read, held there
        loads_b = threading.Thread(target=residency.load, args=(b,), daemon=True)
        loads_b.start()
        deadline = time.monotonic() + 10
        while (got := listed()) != [b]:
            assert got is not None, "the lock was held while the evicted dataset's read ran"
            assert got == [a] and time.monotonic() < deadline, got
            time.sleep(0.01)
        loads_b.join(2)
        assert not loads_b.is_alive(), "b's load waited for a's read"
        (rb,) = residency.all()
        assert ra.stop.is_set() and ra.store._ram  # told to stop, not closed yet: its read runs
        assert rb.loading and rb.store.filled_bytes() == 0  # b reads nothing before a is closed
    finally:
        gate.set()
    try:
        assert rb.wait(10)
        assert not ra.loading and ra.store._ram == {}  # closed: its memory is freed
        assert rb.store.filled_bytes() == SAMPLES * SAMPLE_BYTES
        with h5py.File(b) as f:
            assert np.array_equal(rb.sample(3, "x"), f["x"][3])
    finally:
        residency.close()


def test_a_copy_retired_while_in_use_still_counts_in_the_budget(tmp_path):
    """A dataset whose files changed is read again while sessions keep the old copy: the old
    copy's memory counted no more, so both copies could hold up to twice the budget."""
    path = make_dataset(tmp_path / "a.h5", 1)
    size = SAMPLES * SAMPLE_BYTES
    residency = Residency(budget=size * 3 // 2, threads=1)
    try:
        old = residency.acquire(path)  # a session holds it
        assert old.wait(30) and old.budgeted == size
        os.replace(make_dataset(tmp_path / "new.h5", 2), path)
        new = residency.acquire(path, force=True)
        assert new is not old and old.retired
        assert new.wait(30) and new.budgeted <= size * 3 // 2 - size  # what the old one leaves
        residency.release(old)  # its last session: closed, and its memory goes
        residency.release(new)
        again = residency.acquire(path, force=True)
        assert again is new
        residency.release(again)
    finally:
        residency.close()


class _CountingLink:
    """Node 0's view of a 2-node store whose node 1 holds ``other``: ``Describe`` answered
    from the files there, counted."""

    node, nodes = 0, 2

    def __init__(self, other):
        self.other, self.described = other, 0

    def describe(self, node, template):
        self.described += 1
        return resident.listing(self.other)


def test_a_peers_fetch_asks_no_other_node(tmp_path, monkeypatch):
    """A peer's fetch (``check=False``) compares nothing, so it never asks the other nodes from
    inside the fetch; a session's opening does, at most once a second (``RECHECK_S``)."""
    monkeypatch.setattr(resident, "RECHECK_S", 0.0)
    for node, keys in ((0, (0, 2)), (1, (1, 3))):
        (tmp_path / f"n{node}").mkdir()
        for k in keys:
            np.save(tmp_path / f"n{node}" / f"{k:02d}.npy", np.full(4, k, np.float32))
    link = _CountingLink(str(tmp_path / "n1"))
    res = Residency(link=link)
    path, template = str(tmp_path / "n0"), str(tmp_path / "n{node}")
    r = res.acquire(path, template)  # opened: node 1's listing asked once
    r.wait()
    assert r.owner is not None and link.described == 1
    res.release(res.acquire(path, template))  # a session's opening: asked again
    assert link.described == 2
    for _ in range(3):
        res.release(res.acquire(path, template, check=False))
    assert link.described == 2
    res.release(r)


class _Asking(_CountingLink):
    """Node 1's view of the store (node 0 holds ``other``), keeping the fetches it starts."""

    node = 1

    def __init__(self, other):
        super().__init__(other)
        self.asked = []

    def start(self, dest, request, into):
        self.asked.append((dest, request))


def test_an_owner_whose_files_changed_refuses_a_fetch_of_the_old_global_index(tmp_path):
    """A file staged onto a node while a job ran: the next job's opening had that node read its
    files again, and the running job's fetches of sample i got the new index's sample i
    (batches [23, 24, 25, 26] where [24, 25, 26, 27] were due, silently). A fetch now names
    its copy's global index, and an owner with another refuses it (``ABORTED``)."""
    for node, keys in ((0, (0, 1)), (1, (2, 3))):
        (tmp_path / f"n{node}").mkdir()
        for k in keys:
            np.save(tmp_path / f"n{node}" / f"{k:02d}.npy", np.full(4, k, np.float32))
    path, template = str(tmp_path / "n1"), str(tmp_path / "n{node}")
    res = Residency(link=_Asking(str(tmp_path / "n0")))
    try:
        old = res.acquire(path, template)
        old.wait()
        assert old.pieces([2], ["data"], None, 0, old.index).runs()[0].view(np.float32)[0] == 2
        np.save(tmp_path / "n1" / "02a.npy", np.full(4, 99, np.float32))  # staged meanwhile
        new = res.acquire(path, template, force=True)
        new.wait()
        assert new is not old and new.index != old.index
        with pytest.raises(ServiceError) as refused:
            new.pieces([3], ["data"], None, 0, old.index)  # the old index's 3 is "03": new 4
        assert refused.value.code == "ABORTED" and "other samples" in str(refused.value)
        assert (
            new.pieces_in_ram([3], ["data"], None, 0, new.index).runs()[0].view(np.float32)[0] == 99
        )
        fields = new._asked([], ["data"], None, 0, b"")
        new.start_fetch(np.array([0]), fields, None, 0, {"data": np.zeros((1, 4), np.float32)})
        assert [(d, r["index"]) for d, r in res.link.asked] == [(0, new.index)]
        res.release(old)
        res.release(new)
    finally:
        res.close()


def _shard(path, n):
    with h5py.File(path, "w") as f:
        f["x"] = np.zeros((n, 2), np.float32)
        f["y"] = np.arange(n)


def test_hdf5_shards_on_different_nodes_are_refused_not_served_as_each_nodes_whole(tmp_path):
    """``stage --mode shard`` of an HDF5 set puts whole shards on each node. The store shards
    only files of one sample each, and served each node's share as the whole dataset: a job
    got 16 of 32 samples per epoch, its ranks on each node from different halves, silently."""
    for node, n in ((0, 16), (1, 20)):
        (tmp_path / f"n{node}").mkdir()
        _shard(tmp_path / f"n{node}" / f"part-{node}.h5", n)
    res = Residency(link=_CountingLink(str(tmp_path / "n1")))
    try:
        with pytest.raises(ServiceError) as refused:
            res.acquire(str(tmp_path / "n0"), str(tmp_path / "n{node}"))
        assert refused.value.code == "FAILED_PRECONDITION"
        assert "--mode replicate" in str(refused.value)
        assert res.all() == []
    finally:
        res.close()


def test_a_file_added_to_a_directory_glob_or_spec_makes_the_dataset_read_again(tmp_path):
    """Only the files a dataset had opened were compared: a shard staged into its directory or
    glob, or a spec file edited, went unseen (36 samples served where the files held 48)."""
    d = tmp_path / "shards"
    d.mkdir()
    _shard(d / "part-0.h5", 16)
    _shard(d / "part-1.h5", 20)
    spec = tmp_path / "spec.toml"
    spec.write_text('format = "hdf5"\npaths = ["shards/part-0.h5"]\n')
    paths = [str(d), str(d / "part-*.h5"), str(spec)]
    residency = Residency(threads=1)
    try:
        assert [len(residency.load(p).reader) for p in paths] == [36, 36, 16]
        _shard(d / "part-2.h5", 12)
        spec.write_text('format = "hdf5"\npaths = ["shards/part-*.h5"]\n')
        assert [len(residency.load(p).reader) for p in paths] == [48, 48, 48]
        _shard(d / "part-3.h5", 4)  # matched by the spec's glob
        assert len(residency.load(str(spec)).reader) == 52
    finally:
        residency.close()


def test_hdf5_files_naming_files_outside_the_allowed_roots_are_refused(tmp_path):
    """A virtual dataset's sources and external storage outside ``--allow`` were read and
    served (384.4 KiB of a file outside the roots, through a virtual dataset); then their
    reading-in failed, but the open had shown an external link's fields (float64 (5,), 8
    samples of a file outside): each is refused at the open, naming the file."""
    root, out = tmp_path / "root", tmp_path / "out"
    root.mkdir()
    out.mkdir()
    source = make_dataset(out / "source.h5", 1)
    raw = np.arange(SAMPLES * 4, dtype=np.float32)
    for d in (root, out):
        raw.tofile(d / "raw.bin")
    with h5py.File(root / "virtual.h5", "w") as f:
        layout = h5py.VirtualLayout((SAMPLES, 4, 4, 4), np.float32)
        layout[:] = h5py.VirtualSource(source, "x", shape=(SAMPLES, 4, 4, 4))
        f.create_virtual_dataset("x", layout)
    with h5py.File(root / "linked.h5", "w") as f:
        f["x"] = h5py.ExternalLink(source, "x")
    for name, where in (("outside.h5", out), ("inside.h5", root)):
        with h5py.File(root / name, "w") as f:
            f.create_dataset(
                "x", (SAMPLES, 4), np.float32, external=[(str(where / "raw.bin"), 0, 256)]
            )
    residency = Residency(threads=1, roots=(root,))
    try:
        refused = {}
        for name, reads in (
            ("virtual.h5", source),
            ("linked.h5", source),
            ("outside.h5", str(out / "raw.bin")),
        ):
            with pytest.raises(ServiceError) as err:
                residency.load(str(root / name))
            refused[name] = (err.value.code, str(err.value))
            assert refused[name] == (
                "PERMISSION_DENIED",
                f"{str(root / name)!r} reads {reads!r} (named in its files), "
                f"outside the allowed roots ({root})",
            )
        r = residency.load(str(root / "inside.h5"))
        assert r.wait(30) and r.load_error == ""
        assert [x.path for x in residency.all()] == [str(root / "inside.h5")]
    finally:
        residency.close()


def test_virtual_sources_outside_the_roots_are_refused_unopened(tmp_path, monkeypatch):
    """The roots were checked once the dataset was open, and the open had opened a virtual
    dataset's sources: one outside ``--allow`` was opened (3 opens of files outside for 2
    loads), and one lacking the mapped dataset was ``NOT_FOUND`` naming it. Each is now
    ``PERMISSION_DENIED`` before anything outside the roots is opened."""
    root, out = tmp_path / "root", tmp_path / "out"
    root.mkdir()
    out.mkdir()
    with h5py.File(out / "has.h5", "w") as f:
        f["x"] = np.ones((SAMPLES, 3), np.float32)
    with h5py.File(out / "lacks.h5", "w") as f:
        f["w"] = np.ones((SAMPLES, 3), np.float32)
    for name in ("has.h5", "lacks.h5"):
        with h5py.File(root / name, "w") as f:
            layout = h5py.VirtualLayout((SAMPLES, 3), np.float32)
            layout[:] = h5py.VirtualSource(str(out / name), "x", shape=(SAMPLES, 3))
            f.create_virtual_dataset("x", layout)
    opened, real_file = [], h5py.File
    monkeypatch.setattr(h5py, "File", lambda p, *a, **k: opened.append(p) or real_file(p, *a, **k))
    residency = Residency(threads=1, roots=(root,))
    try:
        for name in ("has.h5", "lacks.h5"):
            with pytest.raises(ServiceError) as err:
                residency.load(str(root / name))
            assert (err.value.code, str(err.value)) == (
                "PERMISSION_DENIED",
                f"{str(root / name)!r} reads {str(out / name)!r} (named in its files), "
                f"outside the allowed roots ({root})",
            )
        assert [p for p in map(str, opened) if not p.startswith(str(root))] == []
    finally:
        residency.close()


def test_virtual_sources_are_looked_for_where_hdf5_looks(tmp_path, monkeypatch):
    """HDF5 looks for a virtual dataset's source in the file's directory, then in the working
    directory (an absolute name that is not there: its last component). A relative source
    beside the file was refused when the service's working directory lay outside ``--allow``
    (``reads '.../out/source.h5'``, not there); an absolute one not there, its name in the
    working directory outside, was served from there."""
    root, out = tmp_path / "root", tmp_path / "out"
    root.mkdir()
    out.mkdir()
    make_dataset(root / "source.h5", 1)
    make_dataset(out / "stray.h5", 2)
    for name, source in (("beside.h5", "source.h5"), ("gone.h5", str(root / "no" / "stray.h5"))):
        with h5py.File(root / name, "w") as f:
            layout = h5py.VirtualLayout((SAMPLES, 4, 4, 4), np.float32)
            layout[:] = h5py.VirtualSource(source, "x", shape=(SAMPLES, 4, 4, 4))
            f.create_virtual_dataset("x", layout)
    monkeypatch.chdir(out)
    residency = Residency(threads=1, roots=(root,))
    try:
        r = residency.load(str(root / "beside.h5"))
        assert r.wait(30) and r.load_error == ""
        with h5py.File(root / "source.h5") as f:
            want = f["x"][:]
        assert np.array_equal(np.stack([r.sample(i, "x") for i in range(SAMPLES)]), want)
        with pytest.raises(ServiceError) as err:
            residency.load(str(root / "gone.h5"))
        assert (err.value.code, str(err.value)) == (
            "PERMISSION_DENIED",
            f"{str(root / 'gone.h5')!r} reads {str(out / 'stray.h5')!r} (named in its files), "
            f"outside the allowed roots ({root})",
        )
    finally:
        residency.close()


def test_virtual_sources_under_hdf5_vds_prefix_or_the_resolved_files_directory(
    tmp_path, monkeypatch
):
    """HDF5 also looks under ``HDF5_VDS_PREFIX`` (first) and in the directory of the file
    with its links resolved (last): a source under the prefix outside ``--allow`` was served
    (its -7.0), and one beside a linked file's target was refused for the working directory
    HDF5 looked in before it (``reads '.../out/source.h5'``, not there)."""
    root, out = tmp_path / "root", tmp_path / "out"
    (root / "real").mkdir(parents=True)
    out.mkdir()
    make_dataset(root / "real" / "source.h5", 1)
    with h5py.File(root / "real" / "virtual.h5", "w") as f:
        layout = h5py.VirtualLayout((SAMPLES, 4, 4, 4), np.float32)
        layout[:] = h5py.VirtualSource("source.h5", "x", shape=(SAMPLES, 4, 4, 4))
        f.create_virtual_dataset("x", layout)
    (root / "virtual.h5").symlink_to(root / "real" / "virtual.h5")
    monkeypatch.chdir(out)
    residency = Residency(threads=1, roots=(root,))
    try:
        r = residency.load(str(root / "virtual.h5"))
        assert r.wait(30) and r.load_error == ""
        with h5py.File(root / "real" / "source.h5") as f:
            assert np.array_equal(r.sample(3, "x"), f["x"][3])
        make_dataset(out / "source.h5", 2)
        monkeypatch.setenv("HDF5_VDS_PREFIX", str(out))
        with pytest.raises(ServiceError) as err:
            residency.load(str(root / "real" / "virtual.h5"))
        assert (err.value.code, str(err.value)) == (
            "PERMISSION_DENIED",
            f"{str(root / 'real' / 'virtual.h5')!r} reads {str(out / 'source.h5')!r} (named in "
            f"its files), outside the allowed roots ({root})",
        )
    finally:
        residency.close()


def test_virtual_sources_found_nowhere_are_not_found(tmp_path, monkeypatch):
    """A virtual dataset whose source is in none of the places HDF5 looks for it was served
    as the fill value (zeros for its samples 8 to 15) without a word: now ``NOT_FOUND``
    naming the file, the dataset and the source; once the source is there it is served."""
    root, cwd = tmp_path / "root", tmp_path / "cwd"
    root.mkdir()
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("HDF5_VDS_PREFIX", raising=False)
    make_dataset(root / "a.h5", 1)
    half = (SAMPLES // 2, 4, 4, 4)
    with h5py.File(root / "virtual.h5", "w") as f:
        layout = h5py.VirtualLayout((SAMPLES, 4, 4, 4), np.float32)
        layout[: SAMPLES // 2] = h5py.VirtualSource("a.h5", "x", shape=(SAMPLES, 4, 4, 4))[
            : SAMPLES // 2
        ]
        layout[SAMPLES // 2 :] = h5py.VirtualSource("b.h5", "x", shape=half)
        f.create_virtual_dataset("x", layout)
    residency = Residency(threads=1, roots=(root,))
    try:
        with pytest.raises(ServiceError) as err:
            residency.load(str(root / "virtual.h5"))
        assert (err.value.code, str(err.value)) == (
            "NOT_FOUND",
            f"{root / 'virtual.h5'}: field 'x': its virtual source 'b.h5' is in none of the "
            f"places HDF5 looks for it ({root / 'b.h5'}, {cwd / 'b.h5'}): HDF5 would read its "
            "samples as the fill value; put the file there (or set HDF5_VDS_PREFIX to its "
            "directory)",
        )
        with h5py.File(root / "b.h5", "w") as f:
            f["x"] = np.full(half, 2, np.float32)
        r = residency.load(str(root / "virtual.h5"))
        assert r.wait(30) and r.load_error == ""
        with h5py.File(root / "a.h5") as f:
            want = np.concatenate([f["x"][: SAMPLES // 2], np.full(half, 2, np.float32)])
        assert np.array_equal(np.stack([r.sample(i, "x") for i in range(SAMPLES)]), want)
    finally:
        residency.close()


def test_a_missing_virtual_source_of_a_later_file_is_found_once_it_is_there(tmp_path):
    """A set of one sample per file whose second file's virtual source is missing fails its
    reading-in naming it (it served zeros); the source put there later changes the dataset,
    which is read again (the failure stayed, ``DATA_LOSS``, until the dataset was unloaded:
    the source was not among the files compared)."""
    for name, source in (("p0.h5", "a.h5"), ("p1.h5", "b.h5")):
        with h5py.File(tmp_path / name, "w") as f:
            layout = h5py.VirtualLayout((4,), np.float32)
            layout[:] = h5py.VirtualSource(source, "x", shape=(4,))
            f.create_virtual_dataset("x", layout)
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f["x"] = np.ones(4, np.float32)
    spec = tmp_path / "set.json"
    spec.write_text(json.dumps({"format": "hdf5-per-sample", "paths": ["p0.h5", "p1.h5"]}))
    residency = Residency(threads=1)
    try:
        r = residency.load(str(spec))
        assert r.wait(30) and "its virtual source 'b.h5' is in none of the places" in r.load_error
        with h5py.File(tmp_path / "b.h5", "w") as f:
            f["x"] = np.full(4, 2, np.float32)
        r = residency.load(str(spec))
        assert r.wait(30) and r.load_error == ""
        assert [r.sample(i, "x").tolist() for i in range(2)] == [[1.0] * 4, [2.0] * 4]
    finally:
        residency.close()


def test_a_later_files_virtual_source_fixed_in_place_is_read_again(tmp_path):
    """A set of one sample per file whose second file's virtual source lacks the mapped
    dataset fails its reading-in naming it; the source rewritten with the dataset changes the
    dataset, which is read again (the failure stayed, ``DATA_LOSS``, until the dataset was
    unloaded: the source, which was there, was not among the files compared)."""
    for name, source in (("p0.h5", "a.h5"), ("p1.h5", "b.h5")):
        with h5py.File(tmp_path / name, "w") as f:
            layout = h5py.VirtualLayout((4,), np.float32)
            layout[:] = h5py.VirtualSource(source, "x", shape=(4,))
            f.create_virtual_dataset("x", layout)
    for name, dataset in (("a.h5", "x"), ("b.h5", "w")):
        with h5py.File(tmp_path / name, "w") as f:
            f[dataset] = np.full(4, 1 + (name == "b.h5"), np.float32)
    spec = tmp_path / "set.json"
    spec.write_text(json.dumps({"format": "hdf5-per-sample", "paths": ["p0.h5", "p1.h5"]}))
    residency = Residency(threads=1)
    try:
        r = residency.load(str(spec))
        assert r.wait(30) and r.load_error == (
            f"{tmp_path / 'p1.h5'}: field 'x': its virtual source 'b.h5' ({tmp_path / 'b.h5'}) "
            "has no dataset 'x': HDF5 would read its samples as the fill value"
        )
        with h5py.File(tmp_path / "b.h5", "a") as f:
            f["x"] = f["w"][:]
        r = residency.load(str(spec))
        assert r.wait(30) and r.load_error == ""
        assert [r.sample(i, "x").tolist() for i in range(2)] == [[1.0] * 4, [2.0] * 4]
    finally:
        residency.close()


def test_a_virtual_source_that_is_itself_virtual_is_looked_into(tmp_path):
    """A virtual dataset whose source in ``--allow`` is itself virtual, its own source
    outside: HDF5 reads through both, and only the first level was checked (the outside
    file's -7.0 was served)."""
    root, out = tmp_path / "root", tmp_path / "out"
    root.mkdir()
    out.mkdir()
    with h5py.File(out / "secret.h5", "w") as f:
        f["x"] = np.full((SAMPLES, 3), -7.0, np.float32)
    for name, source in (("mid.h5", out / "secret.h5"), ("virtual.h5", root / "mid.h5")):
        with h5py.File(root / name, "w") as f:
            layout = h5py.VirtualLayout((SAMPLES, 3), np.float32)
            layout[:] = h5py.VirtualSource(str(source), "x", shape=(SAMPLES, 3))
            f.create_virtual_dataset("x", layout)
    residency = Residency(threads=1, roots=(root,))
    try:
        with pytest.raises(ServiceError) as err:
            residency.load(str(root / "virtual.h5"))
        assert (err.value.code, str(err.value)) == (
            "PERMISSION_DENIED",
            f"{str(root / 'virtual.h5')!r} reads {str(out / 'secret.h5')!r} (named in its "
            f"files), outside the allowed roots ({root})",
        )
    finally:
        residency.close()


def test_external_storage_under_hdf5_extfile_prefix_outside_the_roots_is_refused(
    tmp_path, monkeypatch
):
    """HDF5 reads a relative external storage file under ``HDF5_EXTFILE_PREFIX`` (a leading
    ``${ORIGIN}``: the file's directory): one there outside ``--allow`` was served (its -7.0)."""
    root, out = tmp_path / "root", tmp_path / "out"
    root.mkdir()
    out.mkdir()
    np.full((SAMPLES, 3), -7.0, np.float32).tofile(out / "data.bin")
    with h5py.File(root / "ext.h5", "w") as f:
        f.create_dataset("x", (SAMPLES, 3), np.float32, external=[("data.bin", 0, SAMPLES * 12)])
    monkeypatch.chdir(root)
    residency = Residency(threads=1, roots=(root,))
    try:
        for prefix in (str(out), "${ORIGIN}/../out"):
            monkeypatch.setenv("HDF5_EXTFILE_PREFIX", prefix)
            with pytest.raises(ServiceError) as err:
                residency.load(str(root / "ext.h5"))
            assert (err.value.code, str(err.value)) == (
                "PERMISSION_DENIED",
                f"{str(root / 'ext.h5')!r} reads {str(out / 'data.bin')!r} (named in its files), "
                f"outside the allowed roots ({root})",
            )
    finally:
        residency.close()


def test_directory_datasets_with_entries_linked_out_of_the_roots_are_refused(tmp_path):
    """A Zarr store's chunk, or its array's directory, or an LMDB environment's ``data.mdb``
    linked out of ``--allow`` was served (42.0, the outside file's values)."""
    import zarr

    from datastore.readers.lmdb_format import write_lmdb

    root, out = tmp_path / "root", tmp_path / "out"
    for d in (root, out):
        zarr.open_group(d / "s.zarr", mode="w").create_array(
            "x", shape=(8, 4), chunks=(4, 4), dtype="f4"
        )[:] = 1
        write_lmdb(d / "s.lmdb", [{"x": np.full(4, 1, np.float32)}] * 4)
    linked = {  # the dataset: the entry linked out of the roots
        "s.zarr": "s.zarr/x/c/1/0",
        "d.zarr": "d.zarr/x",
        "s.lmdb": "s.lmdb/data.mdb",
    }
    (root / "d.zarr").mkdir()
    (root / "d.zarr" / "zarr.json").write_bytes((root / "s.zarr" / "zarr.json").read_bytes())
    for entry in linked.values():
        target = out / entry.replace("d.zarr", "s.zarr")
        (root / entry).unlink(missing_ok=True)
        (root / entry).symlink_to(target)
    residency = Residency(threads=1, roots=(root,))
    try:
        for name, entry in linked.items():
            with pytest.raises(ServiceError) as err:
                residency.load(str(root / name))
            target = out / entry.replace("d.zarr", "s.zarr")
            assert (err.value.code, str(err.value)) == (
                "PERMISSION_DENIED",
                f"{str(root / name)!r} reads {str(target)!r} (through {str(root / entry)!r}), "
                f"outside the allowed roots ({root})",
            )
        assert residency.all() == []
    finally:
        residency.close()


@pytest.mark.parametrize("zarr_format, meta", [(3, "zarr.json"), (2, ".zarray")])
def test_a_zarr_array_directory_linked_in_the_roots_with_its_metadata_linked_out_is_refused(
    tmp_path, zarr_format, meta
):
    """A store's array directory linked to one in ``--allow`` whose metadata file links out:
    the links beneath the linked directory went unchecked, and the outside file's metadata was
    shown (1000 samples of float64 (4,) for a store of 8 of float32), then reading it failed
    ``DATA_LOSS``. A link back to a directory already walked is walked once."""
    import zarr

    root, out = tmp_path / "root", tmp_path / "out"
    for d, n, dtype in ((root, 8, "f4"), (out, 1000, "f8")):
        g = zarr.open_group(d / "s.zarr", mode="w", zarr_format=zarr_format)
        g.create_array("x", shape=(n, 4), chunks=(4, 4), dtype=dtype)[:] = 1
    (root / "s.zarr" / "x").rename(root / "x")
    (root / "s.zarr" / "x").symlink_to(root / "x")
    (root / "x" / "back").symlink_to(root / "s.zarr")
    linked = root / "x" / meta
    linked.unlink()
    linked.symlink_to(out / "s.zarr" / "x" / meta)
    store = str(root / "s.zarr")
    with pytest.raises(ServiceError) as err:
        resident._reader(store, (root,))
    assert (err.value.code, str(err.value)) == (
        "PERMISSION_DENIED",
        f"{store!r} reads {str(out / 's.zarr' / 'x' / meta)!r} "
        f"(through {store + '/x/' + meta!r}), outside the allowed roots ({root})",
    )


def test_only_the_links_beneath_a_directory_dataset_are_resolved(tmp_path):
    """Every entry of a Zarr store was resolved at each load under ``--allow`` (3.4 s for a
    store of 4,160 chunks); only a link can lead out of the store's directory."""
    import zarr

    root, out = tmp_path / "root", tmp_path / "out"
    for d in (root, out):
        zarr.open_group(d / "s.zarr", mode="w").create_array(
            "x", shape=(8, 4), chunks=(1, 4), dtype="f4"
        )[:] = 1
    chunk = root / "s.zarr/x/c/3/0"
    chunk.unlink()
    chunk.symlink_to(out / "s.zarr/x/c/3/0")
    store = str(root / "s.zarr")
    assert resident._within([store], (root,)) == [store, str(chunk)]
    with pytest.raises(ServiceError) as err:
        resident._reader(store, (root,))
    assert (err.value.code, str(err.value)) == (
        "PERMISSION_DENIED",
        f"{store!r} reads {str(out / 's.zarr/x/c/3/0')!r} (through {str(chunk)!r}), "
        f"outside the allowed roots ({root})",
    )


def test_a_link_to_an_ancestor_does_not_walk_the_whole_root(tmp_path):
    """A store linking to an ancestor directory in ``--allow`` had the whole root walked: a
    link out anywhere there (another user's dataset) refused a store that never reads it. An
    ancestor is not walked again; a link out beneath the store itself is still refused."""
    import zarr

    root = tmp_path / "root"
    store = root / "data" / "s.zarr"
    zarr.open_group(store, mode="w").create_array("x", shape=(8, 4), dtype="f4")[:] = 1
    (root / "other").mkdir()
    (root / "other" / "out").symlink_to(tmp_path)
    (store / "root").symlink_to(root)
    (store / "x" / "data").symlink_to(root / "data")
    assert sorted(resident._within([str(store)], (root,))) == [
        str(store), str(store / "root"), str(store / "x" / "data"),
    ]  # fmt: skip
    resident._reader(str(store), (root,)).close()
    (store / "x" / "out").symlink_to(tmp_path)
    with pytest.raises(ServiceError) as err:
        resident._reader(str(store), (root,))
    assert err.value.code == "PERMISSION_DENIED" and str(store / "x" / "out") in str(err.value)


def test_a_zarr_chunk_linked_out_of_the_roots_after_the_check_is_refused(tmp_path):
    """A chunk swapped for a link out of ``--allow`` after the dataset was opened (a session
    under a memory budget reads it again every epoch) was served: 101.0 from outside."""
    import zarr

    root, out = tmp_path / "root", tmp_path / "out"
    for d, value in ((root, 1), (out, 101)):
        zarr.open_group(d / "s.zarr", mode="w").create_array(
            "x", shape=(2, 4), chunks=(1, 4), dtype="f4"
        )[:] = value
    reader = resident._reader(str(root / "s.zarr"), (root,))
    got = np.empty(4, np.float32)
    reader.read(1, "x", out=got)
    chunk = root / "s.zarr/x/c/1/0"
    chunk.unlink()
    chunk.symlink_to(out / "s.zarr/x/c/1/0")
    reader.read(0, "x", out=got)
    with pytest.raises(ServiceError) as err:
        reader.read(1, "x", out=got)
    assert (err.value.code, str(err.value), got.tolist()) == (
        "PERMISSION_DENIED",
        f"{str(root / 's.zarr')!r} reads {str(out / 's.zarr/x/c/1/0')!r} (named in its files), "
        f"outside the allowed roots ({root})",
        [1.0] * 4,
    )
    reader.close()


def test_a_read_of_a_file_outside_the_roots_unlinked_since_it_opened_is_refused(tmp_path):
    """A descriptor's path is ``'.../out/... (deleted)'`` once its file is unlinked (replaced
    between the read's open and its check): not there, so it passed as a place HDF5 looks in
    on, and the outside chunk's 101.0 was served."""
    import zarr

    root, out = tmp_path / "root", tmp_path / "out"
    for d, value in ((root, 1), (out, 101)):
        zarr.open_group(d / "s.zarr", mode="w").create_array(
            "x", shape=(2, 4), chunks=(1, 4), dtype="f4"
        )[:] = value
    reader = resident._reader(str(root / "s.zarr"), (root,))
    outside = out / "s.zarr/x/c/1/0"
    fd = os.open(outside, os.O_RDONLY)
    try:
        outside.unlink()
        chunk = root / "s.zarr/x/c/1/0"
        chunk.unlink()
        chunk.symlink_to(f"/proc/self/fd/{fd}")  # (this process' open, unlinked file)
        got = np.zeros(4, np.float32)
        with pytest.raises(ServiceError) as err:
            reader.read(1, "x", out=got)
        assert (err.value.code, str(err.value), got.tolist()) == (
            "PERMISSION_DENIED",
            f"{str(root / 's.zarr')!r} reads {str(outside) + ' (deleted)'!r} (named in its "
            f"files), outside the allowed roots ({root})",
            [0.0] * 4,
        )
    finally:
        os.close(fd)
        reader.close()


def test_a_read_through_a_link_to_one_of_the_services_pipes_is_refused(tmp_path, monkeypatch):
    """A chunk swapped for a link to ``/proc/self/fd/N``, a pipe of the service: the
    descriptor's path, ``pipe:[INODE]``, was taken relative to the working directory, inside
    ``--allow``, and the pipe's 99.0 was served."""
    import zarr

    root = tmp_path / "root"
    zarr.open_group(root / "s.zarr", mode="w").create_array(
        "x", shape=(2, 4), chunks=(1, 4), dtype="f4", compressors=None
    )[:] = 1
    reader = resident._reader(str(root / "s.zarr"), (root,))
    monkeypatch.chdir(root)
    r, w = os.pipe()
    os.write(w, np.full(4, 99.0, np.float32).tobytes())
    os.close(w)  # (the pipe ends there: a read of it does not wait)
    try:
        chunk = root / "s.zarr/x/c/1/0"
        chunk.unlink()
        chunk.symlink_to(f"/proc/self/fd/{r}")
        got = np.zeros(4, np.float32)
        with pytest.raises(DatasetError, match=r"c/1/0: not a regular file \(a FIFO"):
            reader.read(1, "x", out=got)  # (refused as opened: ``open_regular``)
        assert got.tolist() == [0.0] * 4
        pipe = f"/proc/{os.getpid()}/fd/{os.readlink(f'/proc/self/fd/{r}')}"
        assert (opened_path(r), beneath(opened_path(r), (root,))) == (pipe, False)
    finally:
        os.close(r)
        reader.close()


@pytest.mark.parametrize("kind", ["zarr", "npy"])
def test_a_sample_swapped_for_a_fifo_after_the_check_is_refused_not_waited_on(tmp_path, kind):
    """A Zarr chunk or a ``.npy`` sample swapped for a FIFO inside ``--allow`` after the
    dataset was opened: the read's open waited for a writer, for ever."""
    import zarr

    root = tmp_path / "root"
    if kind == "zarr":
        zarr.open_group(root / "s.zarr", mode="w").create_array(
            "x", shape=(2, 4), chunks=(1, 4), dtype="f4"
        )[:] = 1
        path, field, fifo = root / "s.zarr", "x", root / "s.zarr/x/c/1/0"
        said = f"{path}: field 'x': cannot read sample 1: OSError: {fifo}: "
    else:
        (root / "npy").mkdir(parents=True)
        for i in range(2):
            np.save(root / "npy" / f"{i}.npy", np.full(4, 1, np.float32))
        path, field, fifo = root / "npy", "data", root / "npy/1.npy"
        said = f"{fifo}: field 'data': cannot read: {fifo}: "
    reader = resident._reader(str(path), (root,))
    fifo.unlink()
    os.mkfifo(fifo)
    errors = []

    def read():
        try:
            reader.read(1, field, out=np.zeros(4, np.float32))
        except DatasetError as exc:
            errors.append(str(exc))

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(5)
    if t.is_alive():  # (a writer lets the waiting open go)
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    reader.close()
    assert errors == [said + "not a regular file (a FIFO, socket, device or directory)"]


def test_npy_and_tar_samples_linked_out_of_the_roots_after_the_check_are_refused(tmp_path):
    """A sample's .npy file or a tar shard swapped for a link out of ``--allow`` after the
    dataset was opened, before its samples were first read, was served: 42.0 from outside."""
    import tarfile

    root, out = tmp_path / "root", tmp_path / "out"
    for d, value in ((root, 1), (out, 42)):
        (d / "npy").mkdir(parents=True)
        (d / "tar").mkdir()
        for i in range(2):
            np.save(d / "npy" / f"{i}.npy", np.full(4, value, np.float32))
            with tarfile.open(d / "tar" / f"shard-{i}.tar", "w") as t:
                member = io.BytesIO()
                np.save(member, np.full(4, value, np.float32))
                info = tarfile.TarInfo(f"{i}.x.npy")
                info.size = len(member.getvalue())
                t.addfile(info, io.BytesIO(member.getvalue()))
    got = np.empty(4, np.float32)
    for name, field, linked in (("npy", "data", "npy/1.npy"), ("tar", "x", "tar/shard-1.tar")):
        reader = resident._reader(str(root / name), (root,))
        (root / linked).unlink()
        (root / linked).symlink_to(out / linked)
        reader.read(0, field, out=got)
        with pytest.raises(ServiceError) as err:
            reader.read(1, field, out=got)
        assert (err.value.code, str(err.value), got.tolist()) == (
            "PERMISSION_DENIED",
            f"{str(root / name)!r} reads {str(out / linked)!r} (named in its files), "
            f"outside the allowed roots ({root})",
            [1.0] * 4,
        )
        reader.close()


def test_a_shard_of_labels_linked_out_of_the_roots_after_the_check_is_refused(tmp_path):
    """A tar shard holding only ``.cls`` members, swapped for a link out of ``--allow`` after
    the dataset was opened: its labels were served (42 from outside); only ``.npy`` members
    were checked."""
    import tarfile

    root, out = tmp_path / "root", tmp_path / "out"
    for d, label in ((root, 1), (out, 42)):
        d.mkdir()
        for k in range(2):
            with tarfile.open(d / f"shard-{k}.tar", "w") as t:
                info = tarfile.TarInfo(f"{k}.cls")
                info.size = 3
                t.addfile(info, io.BytesIO(f"{label:2d}\n".encode()))
    reader = resident._reader(str(root), (root,))
    (root / "shard-1.tar").unlink()
    (root / "shard-1.tar").symlink_to(out / "shard-1.tar")
    got = np.zeros((), np.int64)
    with pytest.raises(ServiceError) as err:
        reader.read(1, "cls", out=got)
    assert (err.value.code, str(err.value), got.tolist()) == (
        "PERMISSION_DENIED",
        f"{str(root)!r} reads {str(out / 'shard-1.tar')!r} (named in its files), "
        f"outside the allowed roots ({root})",
        0,
    )
    reader.close()


def test_a_sample_file_is_opened_once_at_its_first_read_and_a_later_swap_is_refused(
    tmp_path, monkeypatch
):
    """Under ``--allow`` a sample's first read opened its .npy file once more to check it
    (3 opens, 2 without ``--allow``): the descriptor ``_locate`` opened is checked instead. A
    link out of the roots swapped in after that read is refused by the file's stamp."""
    root, out = tmp_path / "root", tmp_path / "out"
    for d, value in ((root, 1), (out, 42)):
        d.mkdir()
        for i in range(2):
            np.save(d / f"{i}.npy", np.full(4, value, np.float32))
    reader = resident._reader(str(root), (root,))
    opened, os_open = [], os.open
    monkeypatch.setattr(os, "open", lambda p, *a, **k: opened.append(str(p)) or os_open(p, *a, **k))
    got = np.empty(4, np.float32)
    reader.read(1, "data", out=got)  # located (``open_regular``), then read: 2 opens
    assert (opened, got.tolist()) == ([str(root / "1.npy")] * 2, [1.0] * 4)
    (root / "1.npy").unlink()
    (root / "1.npy").symlink_to(out / "1.npy")
    with pytest.raises(DatasetError, match="changed since the dataset was opened"):
        reader.read(1, "data", out=got)
    assert got.tolist() == [1.0] * 4
    reader.close()


def test_a_file_copied_in_place_with_its_size_and_time_is_read_again(tmp_path):
    """``cp -p`` of a file of the same size and modification time (archives' fixed times)
    rewrites it in place, the same inode: the old copy was served (1.0 where the file held 2.0)."""
    old, new, path = (
        make_dataset(tmp_path / n, s) for n, s in (("o.h5", 1), ("n.h5", 2), ("a.h5", 1))
    )
    for p in (old, new, path):
        os.utime(p, ns=(0, 0))
    residency = Residency(threads=1)
    try:
        r = residency.load(path)
        assert r.wait(30)
        with open(new, "rb") as src, open(path, "r+b") as dst:  # cp -p
            dst.write(src.read())
        os.utime(path, ns=(0, 0))
        again = residency.load(path)
        assert again is not r and again.wait(30)
        out = np.empty((4, 4, 4), np.float32)
        again.reader.read(0, "x", out=out)
        with h5py.File(new) as f:
            assert np.array_equal(out, f["x"][0])
    finally:
        residency.close()


def test_a_restart_reloads_no_dataset_outside_its_allowed_roots(tmp_path):
    """A service restarted with other ``--allow`` roots reloaded a spec file outside them from
    its state file, which then could not be unloaded (``PERMISSION_DENIED``)."""
    root = tmp_path / "root"
    root.mkdir()
    inside = make_dataset(root / "a.h5", 1)
    spec = tmp_path / "a.toml"  # outside the root, naming a file inside it
    spec.write_text(f'format = "hdf5"\npaths = ["{inside}"]\n')
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"resident": [[str(spec), str(spec)], [inside, inside]]}))
    events = []
    residency = Residency(
        threads=1, state_file=state, roots=(root,), on_event=lambda e, **k: events.append((e, k))
    )
    try:
        assert residency.restore() == [inside]
        assert [r.path for r in residency.all()] == [inside]
        assert [k["dataset"] for e, k in events if e == "reload_failed"] == [str(spec)]
    finally:
        residency.close()


def test_the_residencys_failures_are_logged_as_warnings():
    """A dataset that could not be reloaded was logged at information level, beside evictions."""
    import io
    import json

    from datastore.service.logs import JsonLog
    from datastore.service.servicer import residency_events

    out = io.StringIO()
    event = residency_events(JsonLog(out))
    event("reload_failed", dataset="/d", msg="gone")
    event("dataset_evicted", dataset="/e", bytes_freed=1)
    event("load_failed", dataset="/f", msg="bad sample")
    levels = [(r["event"], r["level"]) for r in map(json.loads, out.getvalue().splitlines())]
    assert levels == [
        ("reload_failed", "warning"),
        ("dataset_evicted", "info"),
        ("load_failed", "warning"),
    ]


def test_a_dataset_whole_in_memory_leaves_its_hdf5_files_open_to_writers(tmp_path):
    """Once every sample is in memory the service closes the dataset's HDF5 files: their lock
    refused ``h5py.File(path, "r+")`` between jobs (``BlockingIOError``, errno 11), so a file
    could not be rewritten in place for the next job; the new bytes are read again."""
    path = make_dataset(tmp_path / "a.h5", 1)
    residency = Residency(threads=1)
    try:
        r = residency.load(path)
        assert r.wait(30)
        with h5py.File(path, "r+") as f:
            f["x"][0] = 7.0
        again = residency.load(path)
        assert again is not r and again.wait(30)
        out = np.empty((4, 4, 4), np.float32)
        again.reader.read(0, "x", out=out)
        assert np.array_equal(out, np.full((4, 4, 4), 7.0, np.float32))
    finally:
        residency.close()


def test_the_resident_bytes_count_a_changed_copy_still_in_use(tmp_path):
    """A copy whose files changed, kept for its sessions, is memory in use (and in the budget):
    ``datastore status`` said 196.5 KiB resident where 360.5 KiB were held."""
    path = make_dataset(tmp_path / "a.h5", 1)
    residency = Residency(threads=1)
    try:
        old = residency.acquire(path)
        assert old.wait(30)
        os.replace(make_dataset(tmp_path / "new.h5", 2), path)
        new = residency.acquire(path, force=True)
        assert new.wait(30) and old.retired
        assert residency.bytes_resident == 2 * SAMPLES * SAMPLE_BYTES
        residency.release(old)
        assert residency.bytes_resident == SAMPLES * SAMPLE_BYTES
        residency.release(new)
    finally:
        residency.close()


def test_a_dataset_with_a_string_field_is_held_without_it(tmp_path):
    """A field no tensor can hold (HDF5 variable-length strings) is not held: making its slots
    failed (``ValueError: cannot create an OBJECT array from memory buffer``), so a client got
    ``INTERNAL`` even with ``fields=["x"]``; now ``x`` is served and the string field refused by
    the session, naming it."""
    path = make_dataset(tmp_path / "a.h5", 1)
    with h5py.File(path, "a") as f:
        f.create_dataset("name", data=["s"] * SAMPLES, dtype=h5py.string_dtype())
    residency = Residency(threads=1)
    try:
        r = residency.load(path)
        assert r.wait(30) and r.load_error == ""
        assert list(r.store.fields) == ["x"] and r.nbytes == SAMPLES * SAMPLE_BYTES
        with h5py.File(path) as f:
            assert np.array_equal(r.sample(5, "x"), f["x"][5])
    finally:
        residency.close()


def test_a_file_an_external_link_names_rewritten_makes_the_dataset_read_again(tmp_path):
    """Only the dataset's own files were compared with the disk: after the file its external
    link names was rewritten, the service served the old values (0.0 where embedded read
    7.0)."""
    target = make_dataset(tmp_path / "target.h5", 1)
    path = str(tmp_path / "main.h5")
    with h5py.File(path, "w") as f:
        f["x"] = h5py.ExternalLink(target, "/x")
    residency = Residency(threads=1)
    try:
        r = residency.load(path)
        assert r.wait(30)
        with h5py.File(target, "r+") as f:
            f["x"][3] = 7.0
        again = residency.load(path)
        assert again is not r and again.wait(30)
        assert np.array_equal(again.sample(3, "x"), np.full((4, 4, 4), 7.0, np.float32))
    finally:
        residency.close()


def test_a_peers_fetch_by_name_gets_the_copy_a_relinked_path_names_now(tmp_path):
    """A sharded dataset named through a link (``cur -> runA``) pointed at a new directory
    between jobs (``runB``, the same file names): the owner's fetches by the name clients
    give found the old copy, resident under that name beside the new one, so the next job
    got runA's samples from this node and runB's from its own, silently. A peer's Describe
    (every job's opening) now drops a copy that name no longer names."""
    for run, value in (("runA", 0), ("runB", 100)):
        (tmp_path / run).mkdir()
        for k in (0, 2):
            np.save(tmp_path / run / f"{k:02d}.npy", np.full(4, value + k, np.float32))
    (tmp_path / "cur").symlink_to("runA")
    servicer = Servicer(
        config=ServeConfig(socket=tmp_path / "s.sock", allowed_roots=(tmp_path,)),
        listen=[],
        stop=Stop(),
        counters=Counters(),
        log=JsonLog(io.StringIO()),
    )
    fetch = {"kind": "fetch", "path": str(tmp_path / "cur"), "pieces": True, "samples": [0]}
    fetch |= {"fields": ["data"], "spatial": None, "block": 0}

    def first(pieces):
        return pieces.runs()[0].view(np.float32)[0]

    try:
        assert first(servicer.answer(fetch)) == 0  # runA made resident by a fetch
        servicer.residency.all()[0].wait()
        (tmp_path / "cur").unlink()
        (tmp_path / "cur").symlink_to("runB")
        servicer.answer({"kind": "describe", "path": fetch["path"]})  # the next job's opening
        at_once = servicer.answer_at_once(fetch)
        assert at_once is None or first(at_once) == 100
        assert first(servicer.answer(fetch)) == 100
        assert [r.path for r in servicer.residency.all()] == [str(tmp_path / "runB")]
    finally:
        servicer.residency.close()


def test_a_peers_fetch_of_a_sample_that_cannot_be_read_is_data_loss_naming_it(tmp_path):
    """A sample whose virtual source is gone, fetched by a peer: ``INTERNAL`` with no cause
    (``node 1: internal error: SourceMissing`` over MPI, "the service's log says why" over
    gRPC); now ``DATA_LOSS`` naming the file and why, as a client's stream gets it."""
    d = tmp_path / "d"
    d.mkdir()
    with h5py.File(d / "s1-src.h5", "w") as f:
        f["x"] = np.ones(4, np.float32)
    for k in (0, 1):
        with h5py.File(d / f"s{k}.h5", "w") as f:
            f.attrs["datastore_layout"] = "per-sample"
            if k == 0:
                f["x"] = np.zeros(4, np.float32)
            else:
                layout = h5py.VirtualLayout((4,), np.float32)
                layout[:] = h5py.VirtualSource("s1-src.h5", "x", shape=(4,))
                f.create_virtual_dataset("x", layout)
    (d / "s1-src.h5").unlink()
    servicer = Servicer(
        config=ServeConfig(socket=tmp_path / "s.sock", allowed_roots=(tmp_path,)),
        listen=[],
        stop=Stop(),
        counters=Counters(),
        log=JsonLog(io.StringIO()),
    )
    fetch = {"kind": "fetch", "path": str(d), "pieces": True, "samples": [1], "fields": ["x"]}
    try:
        with pytest.raises(ServiceError) as got:
            servicer.answer(fetch | {"spatial": None, "block": 0})
        assert got.value.code == "DATA_LOSS"
        assert str(got.value).startswith(
            f"{d}/s1.h5: field 'x': its virtual source 's1-src.h5' is in none of the places"
        ), got.value
    finally:
        servicer.residency.close()


def test_a_file_that_lands_while_a_dataset_opens_is_read_by_the_next_job(tmp_path, monkeypatch):
    """A staged file renamed into the dataset's directory after its reader listed the files
    but before their state was taken: that state already held it, so no later job saw a
    change, and the copy served 2 samples of 3 for as long as the service ran."""
    for k in (0, 1):
        np.save(tmp_path / f"{k:02d}.npy", np.full(4, k, np.float32))
    open_reader = resident._reader

    def staged_meanwhile(path, roots=()):
        reader = open_reader(path, roots)
        if not (tmp_path / "02.npy").exists():
            np.save(tmp_path / "02.npy", np.full(4, 2, np.float32))
        return reader

    monkeypatch.setattr(resident, "_reader", staged_meanwhile)
    res = Residency()
    try:
        first = res.load(str(tmp_path))
        assert first.num_samples == 2  # (this job's copy: opened before the file landed)
        again = res.load(str(tmp_path))  # the next job
        assert again is not first and again.num_samples == 3
    finally:
        res.close()


def test_the_state_file_is_never_written_through_a_link_planted_beside_it(tmp_path):
    """In a directory others can write, another user's link at the temporary name known in
    advance (``.state.json.PID``) made the service overwrite the link's target with its list."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    state = tmp_path / "state.json"
    (tmp_path / f".state.json.{os.getpid()}").symlink_to(victim)
    residency = Residency(threads=1, state_file=state)
    try:
        path = make_dataset(tmp_path / "a.h5", 1)
        residency.load(path)
        assert victim.read_text() == "precious"
        assert json.loads(state.read_text()) == {"resident": [[path, path]]}
    finally:
        residency.close()


def test_an_lmdb_data_file_linked_out_of_the_roots_after_the_check_is_refused(tmp_path):
    """``data.mdb`` swapped for a link out of ``--allow`` after the dataset was opened (the
    environment is mapped on first read) was served whole: 42.0 from outside."""
    from datastore.readers.lmdb_format import write_lmdb

    root, out = tmp_path / "root", tmp_path / "out"
    for d, value in ((root, 1), (out, 42)):
        write_lmdb(d / "s.lmdb", [{"x": np.full(4, value, np.float32)}] * 2)
    reader = resident._reader(str(root / "s.lmdb"), (root,))
    (root / "s.lmdb" / "data.mdb").unlink()
    (root / "s.lmdb" / "data.mdb").symlink_to(out / "s.lmdb" / "data.mdb")
    got = np.zeros(4, np.float32)
    with pytest.raises(ServiceError) as err:
        reader.read(0, "x", out=got)
    assert (err.value.code, str(err.value), got.tolist()) == (
        "PERMISSION_DENIED",
        f"{str(root / 's.lmdb')!r} reads {str(out / 's.lmdb' / 'data.mdb')!r} (named in its "
        f"files), outside the allowed roots ({root})",
        [0.0] * 4,
    )
    reader.close()


def test_an_hdf5_sample_file_linked_out_of_the_roots_after_the_check_is_refused(tmp_path):
    """A set of one sample per file has no stamps: a sample's file swapped for a link out of
    ``--allow`` after the dataset was opened was served (42.0 from outside)."""
    root, out = tmp_path / "root", tmp_path / "out"
    for d, value in ((root, 1), (out, 42)):
        (d / "ps").mkdir(parents=True)
        for k in range(2):
            with h5py.File(d / "ps" / f"s{k}.h5", "w") as f:
                f["x"] = np.full(4, value, np.float32)
    (root / "spec.toml").write_text('format = "hdf5-per-sample"\npaths = ["ps"]\n')
    reader = resident._reader(str(root / "spec.toml"), (root,))
    (root / "ps" / "s1.h5").unlink()
    (root / "ps" / "s1.h5").symlink_to(out / "ps" / "s1.h5")
    got = np.empty(4, np.float32)
    reader.read(0, "x", out=got)
    with pytest.raises(ServiceError) as err:
        reader.read(1, "x", out=got)
    assert (err.value.code, str(err.value), got.tolist()) == (
        "PERMISSION_DENIED",
        f"{str(root / 'spec.toml')!r} reads {str(out / 'ps' / 's1.h5')!r} (named in its files), "
        f"outside the allowed roots ({root})",
        [1.0] * 4,
    )
    reader.close()


def test_a_compressed_npz_sample_replaced_after_it_was_read_is_refused(tmp_path):
    """A deflated .npz member had no stamp: its file swapped for a link out of ``--allow`` (or
    rewritten) after its first read was read again and served (42.0 from outside)."""
    root, out = tmp_path / "root", tmp_path / "out"
    for d, value in ((root, 1), (out, 42)):
        d.mkdir()
        for i in range(2):
            np.savez_compressed(d / f"{i}.npz", x=np.full(4, value, np.float32))
    reader = resident._reader(str(root), (root,))
    got = np.empty(4, np.float32)
    reader.read(1, "x", out=got)
    (root / "1.npz").unlink()
    (root / "1.npz").symlink_to(out / "1.npz")
    with pytest.raises(DatasetError, match="changed since the dataset was opened"):
        reader.read(1, "x", out=got)
    assert got.tolist() == [1.0] * 4
    reader.close()


def test_a_virtual_sources_own_missing_source_is_not_found(tmp_path, monkeypatch):
    """A virtual dataset whose source is itself virtual, its own source in none of the places
    HDF5 looks: HDF5 reads that part as the fill value; the lookup into the source swallowed
    the refusal (zeros would be served), now ``NOT_FOUND`` naming the inner file and source."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HDF5_VDS_PREFIX", raising=False)
    for name, source in (("mid.h5", "gone.h5"), ("virtual.h5", "mid.h5")):
        with h5py.File(tmp_path / name, "w") as f:
            layout = h5py.VirtualLayout((SAMPLES, 3), np.float32)
            layout[:] = h5py.VirtualSource(source, "x", shape=(SAMPLES, 3))
            f.create_virtual_dataset("x", layout)
    residency = Residency(threads=1, roots=(tmp_path,))
    try:
        with pytest.raises(ServiceError) as err:
            residency.load(str(tmp_path / "virtual.h5"))
        assert err.value.code == "NOT_FOUND"
        assert str(err.value).startswith(
            f"{tmp_path / 'mid.h5'}: field 'x': its virtual source 'gone.h5' is in none of the "
        ), str(err.value)
    finally:
        residency.close()


def test_a_node_whose_copy_failed_to_load_refuses_peers_fetches_of_its_other_samples(tmp_path):
    """A node whose reading-in failed (a truncated sample file) refused its own sessions
    ``DATA_LOSS``, yet sent its other samples to the peers that asked, as if healthy: a job's
    ranks on the other nodes streamed on; now such a fetch is ``DATA_LOSS`` naming the file."""
    d = tmp_path / "d"
    d.mkdir()
    for k in (0, 1):
        np.save(d / f"s{k}.npy", np.full(64, k, np.float32))
    (d / "s1.npy").write_bytes((d / "s1.npy").read_bytes()[:200])
    servicer = Servicer(
        config=ServeConfig(socket=tmp_path / "s.sock", allowed_roots=(tmp_path,)),
        listen=[],
        stop=Stop(),
        counters=Counters(),
        log=JsonLog(io.StringIO()),
    )
    fetch = {"kind": "fetch", "path": str(d), "pieces": True, "samples": [0], "fields": ["data"]}
    fetch |= {"spatial": None, "block": 0}
    try:
        r = servicer.residency.load(str(d))
        assert r.wait(10) and r.load_error
        for answer in (servicer.answer, servicer.answer_at_once):
            with pytest.raises(ServiceError) as got:
                answer(fetch)
            assert got.value.code == "DATA_LOSS"
            assert str(got.value).startswith(
                f"{d} could not be read into memory: {d}/s1.npy: field 'data': not a valid "
                ".npy file: truncated"
            ), got.value
    finally:
        servicer.residency.close()
