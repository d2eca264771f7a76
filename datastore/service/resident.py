"""Datasets held in memory by ``datastore serve``: one resident copy per dataset, shared by jobs.

A dataset becomes resident when a session (or ``LoadDataset``) first asks for it: its samples
go into one :class:`~datastore.store.store.Store` (whole samples, every field), read in the
background and on first use, and every session on the dataset reads from that store. It stays
resident after its sessions end, so the next job of a campaign starts on memory, until it is
unloaded, or evicted (least recently used first, never while a session uses it) to make room
under the memory budget. A dataset that does not fit in what is left gets the room there is;
its other samples are read from the node-local disk on every use.

What is resident is written to a state file; a restarted service reloads those datasets (from
the node-local copies they were opened from) in the background.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import json
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from datastore.errors import DatasetNotFound
from datastore.maths.delivery import (
    Copy,
    Delivered,
    covered,
    covered_sizes,
    delivered_fields,
    pad_copies,
    spatial_grid,
    tensor_dtype_problem,
)
from datastore.maths.ownership import RunOwners
from datastore.maths.partition import Grid
from datastore.readers import open_dataset
from datastore.readers.hdf5_reader import SourceError
from datastore.readers.identity import identity
from datastore.service.errors import ServiceError
from datastore.service.file_state import dataset_paths, files_state, files_stats
from datastore.service.paths import checked_path, shown
from datastore.service.peer_link import Peers, Pending, Pieces, expect
from datastore.store.memory import available_memory
from datastore.store.shards import SHARDABLE, LocalView, owners_by_holders
from datastore.store.store import SlotSpec, Store
from staging.confine import beneath

__all__ = ["Fetching", "Residency", "Resident", "resolve_dataset"]

DESCRIBE_THREADS = 16  # peers asked at once for their files of a dataset
RECHECK_S = 1.0  # a resident dataset's files are compared with the disk at most this often
ASKED_KEPT = 64  # the delivered fields of this many kinds of peers' fetches are kept
RING_SHARE = 8  # datasets leave 1/RING_SHARE of the budget to the jobs' shared-memory rings
FAILURES = frozenset({"load_failed", "reload_failed", "state_unreadable", "state_unwritable"})
"""The residency's events that are failures (logged as warnings; the others as information)."""


def resolve_dataset(path: str, roots: tuple[Path, ...]) -> str:
    """The real path of a dataset a client named; refused outside ``roots`` (when given).

    Checked before anything is resolved (:func:`~datastore.service.paths.checked_path`).
    """
    checked_path(path, "dataset_path")
    real = os.path.realpath(path)
    if roots and not beneath(real, roots):
        raise ServiceError("PERMISSION_DENIED", f"{shown(path)} is {_outside(roots)}")
    pattern = any(c in real for c in "*?[")  # a glob, as the readers take it
    if not (os.path.exists(real) or (pattern and glob.glob(real))):
        raise ServiceError("NOT_FOUND", f"no dataset at {shown(path)} on this node")
    if os.path.exists(real) and not (os.path.isfile(real) or os.path.isdir(real)):
        # Opening a FIFO blocks until a writer comes: the service would hang with it.
        raise ServiceError(
            "INVALID_ARGUMENT", f"{shown(path)} is not a regular file or directory (a FIFO, socket "
            "or device)"
        )  # fmt: skip
    return real


def _outside(roots: tuple[Path, ...]) -> str:
    return f"outside the allowed roots ({', '.join(str(r) for r in roots)})"


@dataclass(frozen=True)
class Fetching:
    """A batch's samples from other nodes, being received into it."""

    positions: frozenset[int]  # the batch positions that come from other nodes
    pending: list[Pending]  # one request per owner
    after: list[Copy]  # once they are in: parts received aside, halos the link did not zero

    def result(self, stop: threading.Event) -> list[Copy] | None:
        """The copies left to do once every owner answered; ``None`` if ``stop`` was set
        first (the requests are then abandoned: :meth:`abandon`). Raises the first owner's
        error."""
        for p in self.pending:
            while not p.wait(0.05):
                if stop.is_set():
                    self.abandon()
                    return None
        for p in self.pending:
            p.result()
        return self.after

    def arrived(self) -> bool:
        """Whether every owner answered (or failed), without waiting."""
        return all(p.wait(0) for p in self.pending)

    def abandon(self) -> None:
        """Give up the requests; return once each is over (bounded: each fails at its
        deadline). A request over may still write into the batch: its slot is reused only
        once :meth:`freed`."""
        for p in self.pending:
            p.abandon()
        for p in self.pending:
            p.wait()

    def freed(self) -> bool:
        """Whether no byte can land in the batch any more (now, without waiting): a request
        that failed while its bytes were coming holds its buffers until they stopped."""
        return all(p.freed(0) for p in self.pending)


@dataclass(eq=False)  # a live object: one is another only if it is the same (list.remove, in)
class Resident:
    """One dataset in memory: its reader, its store and who uses it.

    ``owner[i]`` is the node holding sample ``i`` when the dataset is sharded across the
    services' nodes (``None``: every sample is on this node)."""

    path: str
    reader: Any
    store: Store
    template: str = ""  # the path as clients name it (may hold ``{node}``)
    owner: RunOwners | None = None
    node: int = 0
    link: Peers | None = None
    last_used: float = field(default_factory=time.time)
    sessions: int = 0
    stop: threading.Event = field(default_factory=threading.Event)
    loader: threading.Thread | None = None
    state: bytes = b""  # its (local) files' ``files_state`` when opened (b"": not checked)
    peers_state: bytes = b""  # sharded: a digest of the other nodes' listings when opened
    checked: float = 0.0  # when (``time.monotonic``) the files were last compared with it
    checking: threading.Lock = field(default_factory=threading.Lock)  # one comparison at once
    retired: bool = False  # its files changed: closed once its last session ends
    load_error: str = ""  # why reading it in failed ("": it did not)
    blamed: tuple[str, ...] = ()  # files a failed reading-in blamed (a virtual source's)
    blamed_state: bytes = b""  # their ``files_state`` then: a change (one there, or fixed)
    asked_fields: dict[tuple, list[Delivered]] = field(default_factory=dict)  # peers' asks

    @property
    def num_samples(self) -> int:
        return len(self.reader)

    @functools.cached_property
    def identity(self) -> str:
        """Its files' ``datastore.readers.identity.identity`` (``""`` when sharded across the
        nodes: none sees every file)."""
        return "" if self.owner is not None else identity(self.reader.files)

    @functools.cached_property
    def index(self) -> bytes:
        """Its global index as the services' fetches name it (``b""``: not sharded)."""
        return b"" if self.owner is None else index_digest(self.owner)

    @property
    def nbytes(self) -> int:
        """Bytes of every sample held here, resident or not."""
        return len(self.store.keys) * sum(s.nbytes for s in self.store.fields.values())

    @property
    def budgeted(self) -> int:
        """Bytes of memory this dataset takes (its RAM slots)."""
        return self.store.counters.bytes_resident

    @property
    def loading(self) -> bool:
        return self.loader is not None and self.loader.is_alive()

    def sample(self, index: int, name: str) -> np.ndarray:
        """Field ``name`` of sample ``index`` (read from disk on first use), valid for good:
        a batch's copies run after all its samples are taken, so a sample over the budget,
        read into the thread's scratch, is copied (``Store.lasting``)."""
        return self.store.lasting(index, name)

    def start_fetch(
        self,
        samples: np.ndarray,
        fields: list[Delivered],
        spatial: Any,
        block: int,
        out: dict[str, np.ndarray],
    ) -> Fetching | None:
        """Ask the owners of the ``samples`` other nodes own for them, every owner at once, to
        land straight in the batch ``out`` (``{field: (n, *box)}``: a box's part inside the
        volume lands in place, amid its halo, which the link zeroes right after); returns at
        once. Their boxes are whole once :meth:`Fetching.result`'s copies are done: the
        caller zeroes the halo of the other positions only
        (:func:`~datastore.maths.delivery.batch_pad_copies` with ``skip``). ``None`` when
        every sample is here."""
        if self.owner is None or self.link is None:
            return None
        wanted = np.asarray(samples, dtype=np.int64).reshape(-1).tolist()
        owners = self.owner.owners_of(wanted)  # (a batch's few samples: Python, no numpy)
        by_owner: dict[int, list[int]] = {}
        for pos, o in enumerate(owners):
            if o != self.node:
                by_owner.setdefault(o, []).append(pos)
        if not by_owner:
            return None
        names = [f.name for f in fields]
        pending, after = [], []
        for dest in sorted(by_owner):
            at = by_owner[dest]
            into = []
            for f in fields:  # the reply's order: field after field, sample after sample
                inner = covered(f)[1]
                for pos in at:
                    dst = out[f.name][pos, ...]  # (a view, a 0-d field's too)
                    if f.blocked and dst.flags.c_contiguous:  # the link zeroes its halo
                        into.append((dst, inner))
                        continue
                    part = dst[inner] if f.blocked else dst
                    if part.flags.c_contiguous:
                        into.append(part.reshape(-1).view(np.uint8))
                    else:
                        aside = np.empty(part.shape, part.dtype)
                        into.append(aside.reshape(-1).view(np.uint8))
                        after.append((part, aside))
                    after += pad_copies(f, dst)
            request = {
                "kind": "fetch",
                "path": self.template,
                "samples": [wanted[pos] for pos in at],
                "fields": names,
                "spatial": spatial,
                "block": block,
                "pieces": True,  # (a peer of an older version sent whole boxes)
                "index": self.index,  # (an owner whose files changed since refuses it)
                "expect": _expect(tuple(fields), len(at)),
            }
            pending.append(self.link.start(dest, request, into))
        return Fetching(frozenset(p for at in by_owner.values() for p in at), pending, after)

    def pieces(
        self, samples: list[int], names: list[str], spatial: Any, block: int, index: bytes = b""
    ) -> Pieces:
        """What a peer asked for: ``block`` of every field of ``samples``, its parts inside the
        volume straight from the store, field after field, sample after sample; the asker
        zeroes the halo outside the volume. ``index``: the global index the asker's copy has
        (``b""``: not compared)."""
        return self._pieces(samples, self._asked(samples, names, spatial, block, index))

    def pieces_in_ram(
        self, samples: list[int], names: list[str], spatial: Any, block: int, index: bytes = b""
    ) -> Pieces | None:
        """:meth:`pieces` where every field of ``samples`` is in RAM (views: nothing read);
        ``None`` where one is not."""
        fields = self._asked(samples, names, spatial, block, index)
        views = self.store.ram_views(samples, [f.name for f in fields])
        if views is None:
            return None
        boxes = [covered(f)[0] for f in fields for _ in samples]
        return Pieces(list(zip(views, boxes, strict=True)))

    def _pieces(self, samples: list[int], fields: list[Delivered]) -> Pieces:
        return Pieces(
            [(self.store.lasting(i, f.name), covered(f)[0]) for f in fields for i in samples]
        )

    def _asked(
        self, samples: list[int], names: list[str], spatial: Any, block: int, index: bytes
    ) -> list:
        """The delivered fields of a peer's request, checked (this copy read in whole, its
        samples owned here, its global index this copy's)."""
        self.check_loaded()  # (a peer's job fails as this node's own sessions are refused)
        if index and index != self.index:  # (its sample i is another sample here)
            raise ServiceError(
                "ABORTED",
                f"its copy of {shown(self.template)} holds other samples than the asking "
                "job's (files staged to or removed from a node since one of them read it): "
                "start the job again; if this persists, `datastore load` it on this node",
            )
        n = self.num_samples
        outside = [i for i in samples if not 0 <= i < n]
        if outside:
            raise ServiceError("OUT_OF_RANGE", f"sample {outside[0]} is outside 0..{n - 1}")
        unknown = [f for f in names if f not in self.store.fields]
        if unknown:
            known = ", ".join(self.store.fields)
            raise ServiceError("NOT_FOUND", f"no field {shown(unknown[0])} (fields: {known})")
        if self.owner is not None and samples:
            where = self.owner.owners_of(samples)
            stray = [i for i, o in zip(samples, where, strict=True) if o != self.node]
            if stray:
                raise ServiceError(
                    "FAILED_PRECONDITION", f"sample {stray[0]} is not on node {self.node}"
                )
        key = (tuple(names), repr(spatial), block)  # (a stream asks the same every batch)
        fields = self.asked_fields.get(key)  # (one lookup: another thread may clear it)
        if fields is None:
            fields = self._delivered(names, spatial, block)
            if len(self.asked_fields) >= ASKED_KEPT:
                self.asked_fields.clear()
            self.asked_fields[key] = fields
        return fields

    def _delivered(self, names: list[str], spatial: Any, block: int) -> list[Delivered]:
        info = {f: self.reader.fields[f] for f in names}
        try:
            grid: Grid | None = spatial_grid(info, spatial)
        except ValueError as exc:  # parts of 0, a halo wider than a block, ...
            raise ServiceError("INVALID_ARGUMENT", str(exc)) from None
        blocks = grid.nblocks if grid is not None else 1
        if not 0 <= block < blocks:
            raise ServiceError("OUT_OF_RANGE", f"block {block} is outside 0..{blocks - 1}")
        return delivered_fields(info, grid, block)

    def check_loaded(self) -> None:
        """Raise when reading the dataset in failed: its files are bad or could not be read.

        Raises:
            ServiceError: ``DATA_LOSS`` naming the failure.
        """
        if self.load_error:
            raise ServiceError(
                "DATA_LOSS",
                f"{self.path} could not be read into memory: {self.load_error} (fix its files, "
                f"which are compared at every session's start, or `datastore unload` it and "
                f"load it again)",
            )

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the background read is done; whether it is."""
        if self.loader is not None and self.loader.ident is not None:  # (started)
            self.loader.join(timeout)
        return not self.loading

    def close(self) -> None:
        self.stop.set()
        if self.loader is not None and self.loader.ident is not None:  # never started: no join
            self.loader.join()
        self.store.close()
        self.reader.close()


def _reader(path: str, roots: tuple[Path, ...] = ()) -> Any:
    """The dataset's reader; refused when a file it reads lies outside ``roots`` (a link, a
    spec file naming another place, a file an HDF5 field reads: an external link, external
    storage, a virtual dataset's sources; or pickled records), with the status the loader's
    errors map to."""
    confine = (lambda f: _confined(path, f, roots)) if roots else None
    try:
        reader = open_dataset(path, allow_pickle=False, confine=confine)
    except DatasetNotFound as exc:  # a spec naming a file that is not there
        raise ServiceError("NOT_FOUND", str(exc)) from exc
    except (ValueError, TypeError) as exc:
        raise ServiceError("INVALID_ARGUMENT", str(exc)) from exc
    except OSError as exc:
        raise ServiceError("NOT_FOUND", f"cannot open {path!r}: {exc}") from exc
    if roots:
        real = {f: os.path.realpath(f) for f in _within(reader.files, roots)}
        outside = [f for f, r in real.items() if not beneath(r, roots)]
        if outside:
            reader.close()
            f = outside[0]
            via = f" (through {f!r})" if real[f] != f else ""
            raise ServiceError(
                "PERMISSION_DENIED", f"{path!r} reads {real[f]!r}{via}, {_outside(roots)}"
            )
        try:  # (an external link's file: its fields were shown, then reading it in failed)
            for f in reader.reached:
                if os.path.exists(f):  # (a place that holds nothing: HDF5 looks on)
                    reader.confine(f)
        except ServiceError:
            reader.close()
            raise
    return reader


def _within(files: list[str], roots: tuple[Path, ...]) -> list[str]:
    """``files`` and, of a directory among them (a Zarr store, an LMDB environment), every
    link beneath it: a chunk or ``data.mdb`` linked out of the roots was served, and the open
    reads metadata (an array's ``zarr.json``, LMDB's ``__meta__``) unchecked. Nothing else
    beneath a directory resolves out of it (resolving every entry of a store of 4,160 chunks
    took 3.4 s of each load)."""
    out = []
    for f in files:
        out.append(f)
        if os.path.isdir(f):
            out += _links(f, roots)
    return out


def _links(top: str, roots: tuple[Path, ...]) -> list[str]:
    """The symbolic links beneath the directory ``top``, and beneath each directory linked
    there that lies in ``roots``, each directory once (an array's directory linked to one in
    the roots whose ``zarr.json`` linked out: the outside file's shape and dtype were shown),
    never one holding a directory walked already (a link to an ancestor of ``top`` walked the
    whole root: a link out anywhere there refused a store that never reads it). An
    unreadable directory is skipped, as ``os.walk`` does."""
    found, todo, seen = [], [top], {os.path.realpath(top)}
    while todo:
        try:
            with os.scandir(todo.pop()) as entries:
                for e in entries:
                    if e.is_symlink():
                        found.append(e.path)
                        real = os.path.realpath(e.path) if e.is_dir() else None
                        if real is not None and beneath(real, roots) and _apart(real, seen):
                            seen.add(real)
                            todo.append(e.path)
                    elif e.is_dir(follow_symlinks=False):
                        todo.append(e.path)
        except OSError:
            continue
    return found


def _apart(real: str, seen: set[str]) -> bool:
    """Whether the directory ``real`` is none of ``seen`` and holds none of them."""
    return not any(beneath(s, [real]) for s in seen)


def _read_files(reader: Any) -> list[str]:
    """The files ``reader`` reads: its own and those they name (HDF5's external links, ...):
    a dataset whose linked file is rewritten is read again too."""
    return [*reader.files, *reader.reached]


@functools.lru_cache(maxsize=256)
def _expect(fields: tuple[Delivered, ...], n: int) -> tuple[tuple[int, int], ...]:
    """The ``expect`` of a fetch of ``n`` samples' ``fields`` (the same every batch)."""
    sizes = [m for f in fields for _ in range(n) for m in covered_sizes(f)]
    return tuple(map(tuple, expect(sizes)))


def _confined(path: str, reached: str, roots: tuple[Path, ...]) -> None:
    """Refuse a file that the dataset at ``path`` reaches from inside its own (HDF5's external
    links and storage, virtual datasets), or a descriptor a read opened, when it lies outside
    ``roots``, there or not (an open file unlinked since is ``'... (deleted)'``: one outside
    was served)."""
    real = os.path.realpath(reached)
    if not beneath(real, roots):
        raise ServiceError(
            "PERMISSION_DENIED", f"{path!r} reads {real!r} (named in its files), {_outside(roots)}"
        )


def listing(path: str, roots: tuple[Path, ...] = ()) -> tuple[bool, list[str], dict[str, Any]]:
    """``(shardable, local file names, field signature)`` of the dataset at ``path`` here
    (refused when it reads a file outside ``roots``)."""
    reader = _reader(path, roots)
    try:
        root = path if os.path.isdir(path) else os.path.dirname(path)
        ok = getattr(reader, "format", None) in SHARDABLE and hasattr(reader, "files")
        names = sorted(os.path.relpath(f, root) for f in getattr(reader, "files", ()))
        signature = {n: (str(f.dtype), tuple(f.shape)) for n, f in reader.fields.items()}
        return ok, names, signature
    finally:
        reader.close()


def index_digest(owner: RunOwners) -> bytes:
    """A sharded dataset's global index (its owners' runs) as 16 bytes."""
    runs = owner.starts.tobytes() + owner.ranks.tobytes() + owner.num_samples.to_bytes(8, "little")
    return hashlib.blake2b(runs, digest_size=16).digest()


def _digest(listings: dict[int, Any]) -> bytes:
    """What the other nodes hold of a sharded dataset, as one digest (their listings)."""
    return hashlib.blake2b(repr(sorted(listings.items())).encode(), digest_size=16).digest()


def _held(reader: Any) -> dict[str, Any]:
    """The fields of ``reader`` a batch can carry (numbers and bools): only they are held; a
    session asking for another is refused naming it (``chosen_fields``)."""
    return {n: f for n, f in reader.fields.items() if tensor_dtype_problem(f.dtype) is None}


def _open(path: str, budget: int | None, keys: np.ndarray, reader: Any) -> Resident:
    specs = {n: SlotSpec(tuple(fi.shape), np.dtype(fi.dtype)) for n, fi in _held(reader).items()}
    store = Store(keys, specs, lambda k, f, out: reader.read(k, f, out=out), budget)
    return Resident(path, reader, store)


class Residency:
    """The resident datasets of one service, under one memory budget.

    Args:
        budget: bytes of memory for datasets; ``None``: no limit.
        state_file: where the list of resident datasets is kept across restarts. Default: none.
        on_event: ``on_event(name, **fields)`` for the log. Default: nothing.
        threads: reads at a time when loading. Default: ``4``.
        link: the other services of a multi-node store. Default: none (one node).
        roots: a dataset reading a file outside these (a link, a spec file naming another
            place) is refused. Default: any.
    """

    def __init__(
        self,
        budget: int | None = None,
        state_file: Path | None = None,
        on_event: Any = None,
        threads: int = 4,
        link: Peers | None = None,
        roots: tuple[Path, ...] = (),
    ) -> None:
        self.link, self.roots = link, roots
        self.node = link.node if link is not None else 0
        self.budget = budget
        self.state_file = state_file
        self._event = on_event or (lambda *_a, **_k: None)
        self._threads = threads
        self._lock = threading.Lock()
        self.ring_bytes = 0  # clients' shared-memory rings, counted in the budget too
        self.inline_bytes = 0  # inline streams' batches, together under the whole budget
        self._by_path: dict[str, Resident] = {}
        self._retired: list[Resident] = []  # files changed, still used: in the budget until closed

    # -- use -----------------------------------------------------------------------------------
    def acquire(
        self, path: str, template: str = "", force: bool = False, check: bool = True
    ) -> Resident:
        """The resident copy of the dataset at real path ``path`` (``template``: as clients
        name it), loaded if need be; counted as used by one more session until :meth:`release`.
        ``force``: compare its files with the disk now, however recently that was done;
        ``check=False``: not at all (a peer's fetch: its session's opening had this node
        compare its files through ``Describe``, and asking the other nodes from inside a
        fetch could leave two nodes' answering threads waiting on each other)."""
        template = template or path
        if check:
            self._forget_if_changed(path, force)
        opened: tuple[Any, RunOwners | None] | None = None
        state = (b"", b"")
        while True:
            with self._lock:
                r = self._by_path.get(path)  # (or loaded by another call while we opened it)
                if r is None and opened is not None:
                    r, opened = self._load_locked(path, template, opened, state), None
                if r is not None:
                    r.sessions += 1
                    r.last_used = time.time()
                    break
            # Opening a dataset (its files' metadata, the peers' listings) may take long:
            # never with the lock held, which Status and every other call need.
            # (the files as they were before: one landing while it opens is a change)
            named = dataset_paths(path)
            seen = files_stats(named)
            sharded = self._shards(path, template)
            if sharded is None:
                opened = _reader(path, self.roots), None
                state = files_state([*named, *_read_files(opened[0])], seen), b""
            else:
                view, owner, theirs = sharded
                local = files_state([*named, *_read_files(view.local)], seen)
                opened, state = (view, owner), (local, theirs)
        if opened is not None:  # another call loaded it meanwhile
            opened[0].close()
        self._forget_renamed(template, path)
        return r

    def acquire_named(self, template: str) -> Resident | None:
        """The resident dataset clients call ``template``, if one is, held as
        :meth:`acquire` holds it (until :meth:`release`): no file system call (its path was
        checked when it was loaded)."""
        with self._lock:
            for r in self._by_path.values():
                if r.template == template:
                    r.sessions += 1
                    r.last_used = time.time()
                    return r
        return None

    def release(self, r: Resident) -> None:
        with self._lock:
            r.sessions -= 1
            r.last_used = time.time()
            done = r.retired and r.sessions == 0
            if done:
                self._retired.remove(r)
        if done:
            r.close()

    def check_local(self, path: str, template: str = "") -> None:
        """Forget the resident copy of ``path`` if this node's files of it changed (a peer
        describing this node's share before it reads the dataset again: the copy this node
        would otherwise send it is stale), and any copy clients call ``template`` that is not
        at ``path``, what it names now; skipped while a comparison is under way here."""
        self._forget_if_changed(path, force=True, peers=False)
        self._forget_renamed(template or path, path)

    def _forget_renamed(self, template: str, path: str) -> None:
        """Forget the resident copies clients call ``template`` that are not at ``path``, what
        it names now (a link to the dataset's directory pointed at a new one): a peer's fetch
        finds a copy by that name (:meth:`acquire_named`), and took the old one's samples."""
        with self._lock:
            old = [r for p, r in self._by_path.items() if r.template == template and p != path]
            idle = [r for r in old if self._retire_locked(r)]
            if old:
                self._save_locked()
        for r in old:
            self._event("dataset_changed", dataset=r.path, msg=f"{template} now names {path}")
        for r in idle:
            r.close()

    def _retire_locked(self, r: Resident) -> bool:
        """Forget ``r``, kept until its last session ends; whether none uses it now."""
        del self._by_path[r.path]
        r.retired = True
        if r.sessions:
            self._retired.append(r)
        return r.sessions == 0

    def _forget_if_changed(self, path: str, force: bool = False, peers: bool = True) -> None:
        """Forget the resident copy of ``path`` if its files changed on disk since it was
        opened (compared at most every ``RECHECK_S`` unless ``force``: a job's ranks open their
        sessions at once, and wait for a comparison under way), so that it is read again;
        sessions using it keep it until they end, and its memory counts until then. A dataset
        sharded over the store's nodes changed if this node's files did or another node's
        listing did (each asked: ``Describe``, which has that node compare its own files
        too); ``peers=False``: this node's files only."""
        with self._lock:
            r = self._by_path.get(path)
        if r is None or not r.state:
            return
        if not r.checking.acquire(blocking=peers):  # (a peer asking: the check under way will do)
            return
        try:  # (a stat per file, the peers' listings: not under the residency's lock)
            if not force and time.monotonic() - r.checked < RECHECK_S:
                return
            local = _read_files(r.reader.local if r.owner is not None else r.reader)
            same = files_state([*dataset_paths(path), *local]) == r.state
            same = same and (not r.blamed or files_state(r.blamed) == r.blamed_state)
            if same and peers and r.owner is not None:
                same = _digest(self._describe_others(r.template)) == r.peers_state
            if peers or r.owner is None:
                r.checked = time.monotonic()
        finally:
            r.checking.release()
        if same:
            return
        with self._lock:
            if self._by_path.get(path) is not r:
                return
            idle = self._retire_locked(r)
            self._save_locked()
        self._event(
            "dataset_changed", dataset=path, msg="its files changed on disk: it is read again"
        )
        if idle:
            r.close()

    def load(self, path: str, template: str = "") -> Resident:
        """Make ``path`` resident (or touch it) without holding it."""
        r = self.acquire(path, template, force=True)
        self.release(r)
        return r

    def unload(self, path: str) -> int:
        """Drop ``path``; the bytes freed. Refused while a session uses it."""
        with self._lock:
            r = self._by_path.get(path)
            if r is None:
                raise ServiceError("NOT_FOUND", f"{path!r} is not resident")
            if r.sessions:
                raise ServiceError(
                    "FAILED_PRECONDITION", f"{path!r} is used by {r.sessions} open session(s)"
                )
            del self._by_path[path]
            self._save_locked()
        freed = r.budgeted
        r.close()
        self._event("dataset_unloaded", dataset=path, bytes_freed=freed)
        return freed

    def all(self) -> list[Resident]:
        with self._lock:
            return list(self._by_path.values())

    @property
    def bytes_resident(self) -> int:
        """Bytes of the datasets in memory, with the copies whose files changed that sessions
        still use (the budget counts them too)."""
        with self._lock:
            return sum(r.budgeted for r in [*self._by_path.values(), *self._retired])

    def restore(self) -> list[str]:
        """Reload what the state file lists (in the background); the paths being reloaded."""
        if self.state_file is None or not self.state_file.exists():
            return []
        try:
            saved = json.loads(self.state_file.read_text())["resident"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self._event("state_unreadable", path=str(self.state_file), msg=str(exc))
            return []
        done = []
        for entry in saved:
            if not (isinstance(entry, list) and len(entry) == 2):
                continue
            p, template = entry
            try:  # (the roots may have changed since: one outside could not be unloaded)
                self.load(resolve_dataset(p, self.roots), template)
                done.append(p)
            except ServiceError as exc:
                self._event("reload_failed", dataset=p, msg=str(exc))
        return done

    def close(self) -> None:
        with self._lock:
            every, self._by_path = list(self._by_path.values()), {}
        for r in every:
            r.close()

    # -- internals -----------------------------------------------------------------------------
    def _describe_others(self, template: str) -> dict[int, Any]:
        """Every other node's listing of ``template`` (``Describe``), by node."""
        assert self.link is not None
        link, others = self.link, [n for n in range(self.link.nodes) if n != self.node]
        with ThreadPoolExecutor(min(DESCRIBE_THREADS, len(others))) as pool:  # one wait, not N
            asked = pool.map(lambda n: link.describe(n, template), others)
            return dict(zip(others, asked, strict=True))

    def _shards(self, path: str, template: str) -> tuple[Any, RunOwners, bytes] | None:
        """``(reader of the global index, owner, digest of the other nodes' listings)`` when
        the nodes hold different files of ``template``; ``None`` when every node holds every
        sample (or there is one node)."""
        if self.link is None or self.link.nodes == 1:
            return None
        mine = listing(path, self.roots)
        link, theirs = self.link, self._describe_others(template)
        every = [mine if n == self.node else theirs[n] for n in range(link.nodes)]
        if all(held == mine[1] for _, held, _ in every):
            return None
        if not all(ok for ok, _, _ in every):  # (each node served its own share as the whole)
            raise ServiceError(
                "FAILED_PRECONDITION",
                f"the nodes hold different files of {shown(template)}, and the store shards "
                "only datasets of one sample per file (.npy/.npz, HDF5 per sample): stage it "
                "with --mode replicate, or as files of one sample each",
            )
        if any(sig != mine[2] for _, _, sig in every):
            raise ServiceError(
                "FAILED_PRECONDITION", f"the nodes' shards of {template!r} have different fields"
            )
        holders = [held for _, held, _ in every]
        names = sorted(set().union(*holders))
        view = LocalView.of_names(_reader(path, self.roots), names, mine[1])
        return view, owners_by_holders(names, holders), _digest(theirs)

    def _load_locked(
        self,
        path: str,
        template: str,
        opened: tuple[Any, RunOwners | None],
        state: tuple[bytes, bytes],
    ) -> Resident:
        reader, owner = opened
        keys = np.arange(len(reader)) if owner is None else owner.keys_of(self.node)
        need = len(keys) * sum(fi.nbytes for fi in _held(reader).values())
        evicted: list[Resident] = []
        keep = self.budget // RING_SHARE if self.budget is not None else 0
        room = self._make_room_locked(need, evicted, keep)
        r = _open(path, room, keys, reader)
        r.template, r.owner, r.node, r.link = template, owner, self.node, self.link
        (r.state, r.peers_state), r.checked = state, time.monotonic()
        r.loader = threading.Thread(
            target=self._preload, args=(r, evicted), name="datastore-load", daemon=True
        )
        self._by_path[path] = r
        self._save_locked()
        self._event(
            "dataset_loading",
            dataset=path,
            bytes=need,
            bytes_in_memory=r.budgeted,
            room=room,
            sharded=owner is not None,
        )
        r.loader.start()
        return r

    def _preload(self, r: Resident, evicted: list[Resident]) -> None:
        for victim in evicted:  # their memory goes before this dataset's comes
            victim.close()
        t0 = time.perf_counter()
        try:
            r.store.preload(self._threads, stop=r.stop)
        except Exception as exc:  # a bad sample: loads and new sessions are refused, naming it
            r.blamed = exc.places if isinstance(exc, SourceError) else ()
            r.blamed_state = files_state(r.blamed)
            r.load_error = str(exc)
            self._event("load_failed", dataset=r.path, msg=str(exc))
            return
        if not r.stop.is_set():
            if r.owner is None and r.store.ram_slots == len(r.store.keys):
                r.reader.release()  # all in memory: its HDF5 files' locks kept writers out
            self._event(
                "dataset_resident",
                dataset=r.path,
                bytes=r.budgeted,
                seconds=round(time.perf_counter() - t0, 3),
            )

    def reserve_ring(self, nbytes: int) -> None:
        """Count a client's shared-memory ring of ``nbytes`` in the budget, evicting idle
        datasets to make room.

        Raises:
            ServiceError: ``RESOURCE_EXHAUSTED`` when it does not fit even then.
        """
        evicted: list[Resident] = []
        try:
            with self._lock:
                room = self._make_room_locked(nbytes, evicted)
                if room is not None and room < nbytes:
                    raise ServiceError(
                        "RESOURCE_EXHAUSTED",
                        f"a shared-memory ring of {nbytes} bytes does not fit under the memory "
                        f"budget of {self.budget} bytes ({self.budget - room} in use)",
                    )
                self.ring_bytes += nbytes
        finally:
            for victim in evicted:
                victim.close()

    def reserve_inline(self, nbytes: int, batches: int) -> None:
        """Count an inline stream's ``batches`` of ``nbytes`` in all beside the other inline
        streams': together they may hold the whole budget (beside the resident datasets),
        with no budget each one the memory available. Counted one by one, eight streams of 40
        MiB under a budget of 64 MiB took the service from 137 MiB to 594 MiB; alone, a batch
        of 2,048 samples of 1 MiB took it to 4 GiB under 128 KiB, and with no budget
        1,000,000 of them took 14 GiB, every call waiting until the service was killed.

        Raises:
            ServiceError: ``RESOURCE_EXHAUSTED``.
        """
        with self._lock:
            limit = available_memory() if self.budget is None else self.budget
            used = 0 if self.budget is None else self.inline_bytes
            if limit is not None and used + nbytes > limit:
                what = "the memory available" if self.budget is None else "the memory budget"
                beside = f" beside {used} bytes of other inline streams" if used else ""
                raise ServiceError(
                    "RESOURCE_EXHAUSTED",
                    f"an inline stream's {batches} batches of {nbytes // batches} bytes{beside} "
                    f"exceed {what} of {limit} bytes: ask for smaller batches or less prefetch",
                )
            self.inline_bytes += nbytes

    def release_inline(self, nbytes: int) -> None:
        """Give back what :meth:`reserve_inline` counted."""
        with self._lock:
            self.inline_bytes -= nbytes

    def release_ring(self, nbytes: int) -> None:
        """Give back what :meth:`reserve_ring` counted."""
        with self._lock:
            self.ring_bytes -= nbytes

    def _make_room_locked(self, need: int, evicted: list[Resident], keep: int = 0) -> int | None:
        """Evict unused datasets, least recently used first, until ``need`` fits; the budget
        the new dataset (or ring) gets (``None``: no limit): ``need``, or when it does not fit
        the room left less what of ``keep`` the rings do not use yet.

        The evicted datasets are told to stop loading and added to ``evicted``, for the caller
        to close once the lock is released: closing one that is still loading waits for its
        reads in flight (seconds), and Status and every other call need the lock."""
        if self.budget is None:
            return None
        kept = [*self._by_path.values(), *self._retired]
        used = sum(r.budgeted for r in kept) + self.ring_bytes
        idle = sorted(
            (r for r in self._by_path.values() if not r.sessions), key=lambda r: r.last_used
        )
        while used + need > self.budget and idle:
            victim = idle.pop(0)
            del self._by_path[victim.path]
            victim.stop.set()
            freed = victim.budgeted
            used -= freed
            evicted.append(victim)
            self._event("dataset_evicted", dataset=victim.path, bytes_freed=freed)
        room = self.budget - used
        return need if need <= room else max(0, room - max(0, keep - self.ring_bytes))

    def _save_locked(self) -> None:
        if self.state_file is None:
            return
        saved = sorted((r.path, r.template) for r in self._by_path.values())
        tmp = None
        try:
            self.state_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            # a new file of a random name: in a directory others can write, a link they put
            # at a name known in advance (.NAME.PID) had the service overwrite its target
            fd, tmp = tempfile.mkstemp(
                prefix=f".{self.state_file.name}.", dir=self.state_file.parent
            )
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps({"resident": saved}))
            os.replace(tmp, self.state_file)
        except OSError as exc:  # only a restart misses it: the load or unload itself stands
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            self._event("state_unwritable", path=str(self.state_file), msg=str(exc))
