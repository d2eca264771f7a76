"""One ``datastore stage`` run across all ranks: prepare, plan, skip, pre-flight, copy, record.

Every collective below is reached by every rank in the same order whatever happens locally:
local failures travel as values (``allgather`` of errors, an exit code reduction), never as a
rank that leaves early, so one failing rank cannot hang the others.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from staging.checksum import LEAF_BYTES
from staging.cluster import Layout, layout
from staging.config import StageConfig
from staging.confine import leads_out
from staging.copy import (
    Engine,
    Stats,
    fd_path,
    mode_mask,
    open_beneath,
    opened_beneath,
    settle_dirs,
)
from staging.directio import IoPolicy
from staging.exitcodes import Agreed, Exit
from staging.manifest import Manifest, lock_dest, meta_dir, open_meta, same_meta
from staging.plan import Group, Item, Plan, archive_record, assign, build_plan, split_by_bytes
from staging.progress import MIB, Progress, human_bytes
from staging.tmpspace import Freed, clean_tmp, drop_partials

__all__ = [
    "locked_message", "planned_names", "stage", "stale_files", "summary_line", "trees_to_clean",
    "whole_archives",
]  # fmt: skip


@dataclass
class NodeWork:
    """What the leader of a node decided, sent to every rank of the node."""

    per_rank: list[list[Group]] = field(default_factory=list)
    skipped: int = 0
    skipped_bytes: int = 0
    todo_bytes: int = 0
    modes: list[tuple[str, int]] = field(default_factory=list)  # up to date, mode changed
    error: str | None = None
    code: int = 0


def up_to_date(item: Item, entry: dict[str, Any] | None, dest: str) -> bool:
    """True when ``item`` was staged from the same source state and is still in place as the
    stage left it: a link to the same target, a file of the recorded size and the source's
    mtime (one ``lstat``: a file changed or removed in DEST is copied again)."""
    return _staged(item, entry, dest) is not None


def _staged(item: Item, entry: dict[str, Any] | None, dest: str) -> os.stat_result | None:
    """:func:`up_to_date`'s ``lstat`` of ``item`` in DEST where it is up to date, else ``None``."""
    if entry is None or entry["source"] != item.source or entry["ident"] != item.ident:
        return None
    try:
        st = os.lstat(os.path.join(dest, item.dest))
    except OSError:
        return None
    if item.kind == "symlink":
        same = stat.S_ISLNK(st.st_mode) and os.readlink(os.path.join(dest, item.dest)) == item.link
        return st if same else None
    # DEST's mtime may be cut to the second (Lustre, ext4 of 128-byte inodes, NFSv3, exFAT):
    # what the stage set, truncated, and never the later time of a write since
    behind = item.mtime_ns - st.st_mtime_ns
    same = stat.S_ISREG(st.st_mode) and st.st_size == entry["size"] and 0 <= behind < 10**9
    return st if same else None


def _node_work(
    groups: list[Group], manifest: Manifest, dest: str, local_size: int, mask: int
) -> NodeWork:
    """Skip what is up to date (noting those whose source's mode changed, as ``mask`` lets
    it be written) and split the rest over the node's ranks."""
    work = NodeWork()
    todo: list[Group] = []
    for g in groups:
        keep = []
        for item in g.items:
            if item.kind == "dir":
                continue  # made by the caller once the space check has passed
            st = _staged(item, manifest.entries.get(item.dest), dest)
            if st is not None:
                work.skipped += 1
                work.skipped_bytes += item.size
                if item.kind == "file" and stat.S_IMODE(st.st_mode) != item.mode & mask:
                    work.modes.append((item.dest, item.mode & mask))
            else:
                keep.append(item)
                work.todo_bytes += item.size
        if keep:
            todo.append(Group(g.source, tuple(keep), g.stream, g.ident))
    # units: every item of a range group alone, a stream group whole
    units: list[tuple[Group, Item | None]] = []
    for g in todo:
        units.extend([(g, None)] if g.stream else [(g, i) for i in g.items])
    sizes = [g.nbytes if i is None else i.size for g, i in units]
    owners = split_by_bytes(sizes, local_size)
    per_rank: list[dict[str, list[Item]]] = [{} for _ in range(local_size)]
    for (g, i), r in zip(units, owners, strict=False):
        per_rank[r].setdefault(g.source, []).extend(g.items if i is None else [i])
    by_src = {g.source: g for g in todo}
    work.per_rank = [
        [
            Group(src, tuple(items), by_src[src].stream, by_src[src].ident)
            for src, items in d.items()
        ]
        for d in per_rank
    ]
    return work


def stage(cfg: StageConfig, comm: Any) -> int:
    """Run the stage on this rank; returns the exit code (the same on every rank)."""
    t0 = time.perf_counter()
    lay, node_comm = layout(comm, cfg.ranks_per_node)
    dest = cfg.dest_for(lay.node)
    log = _Log(cfg, lay)

    # 1. every node's leader prepares its DEST and takes the lock
    lock_fd, meta, manifest, err, freed = None, None, Manifest(), None, Freed()
    made: list[str] = []  # DEST/.datastore and the parents this run creates, deepest first
    code = Exit.FAILED
    if lay.is_leader:
        try:
            if cfg.confine and leads_out(dest, cfg.confine):  # a link swapped in since asked
                raise ValueError(
                    f"a link leads it out of the allowed roots ({', '.join(cfg.confine)})"
                )
            made = _absent(meta_dir(dest))
            with contextlib.suppress(FileExistsError):  # (a link there, dangling too: named next)
                os.makedirs(meta_dir(dest))
            meta = open_meta(dest)  # the lock, manifest, journals and temp space: through it
            lock_fd = lock_dest(dest, meta)
            manifest = Manifest.load(dest, meta)
            freed = clean_tmp(meta)
            with contextlib.suppress(FileExistsError):  # here, where a full DEST is an answer
                os.mkdir("tmp", dir_fd=meta)
        except BlockingIOError:  # what is there is the other run's: nothing is removed
            err, made = locked_message(dest, cfg.dest, lay), []
        except (OSError, ValueError) as exc:
            why = getattr(exc, "strerror", None) or exc
            if getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
                why, code = f"{why}: no space, or no inode, left for its own files", Exit.NO_SPACE
            err = f"{dest}: cannot prepare destination ({why})"
    failed = [(e, c) for e, c in comm.allgather((err, code)) if e]
    if failed:
        # nothing is staged on any node: what this run made here goes (a failed makedirs or
        # lock left DEST/.datastore, and DEST itself, behind)
        _unmake(dest, made)
        _close(lock_fd, meta)
        log.errors([e for e, _ in failed])
        return Agreed(max(c for _, c in failed))

    # 2. rank 0 plans (the sources are shared); each node's leader gets its node's groups.
    #    A stage of one process writes an uncompressed tar's members to hidden temp files as
    #    the walk finds them (Engine.ahead); step 3 keeps them once the archive is known good.
    plan = Plan()
    if not lay.is_leader:  # its own descriptor, for its Engine: a refusal is said in step 3
        meta, err = _open_meta(dest)
    policy = IoPolicy(cfg.io, meta_dir(dest), log=lay.is_leader and not cfg.quiet, dir_fd=meta)
    engine = _engine(cfg, dest, lay.rank, policy, meta) if lay.size == 1 else None
    if lay.rank == 0:
        try:
            plan = build_plan(
                list(cfg.sources), cfg.unpack, whole_archives(manifest), cfg.io, cfg.confine, dest,
                ahead=engine.ahead if engine is not None else None,
            )  # fmt: skip
        except BaseException:
            if engine is not None:
                engine.settle([])
                engine.close()
            raise
        log.notes(plan.notes)
    groups = _node_groups(plan, cfg.mode, comm, lay)
    planned = comm.bcast(bool(plan.groups) if lay.rank == 0 else None, root=0)
    # the sources of this run (one per SRC), whose files outside this node's share are dropped
    # from it once the copy is done (``_drop``; those in the way of the new plan before it)
    trees, limit = comm.bcast(
        (trees_to_clean(plan, cfg.mode), planned_names(plan, cfg.mode)) if lay.rank == 0 else None
    )

    # 3. the leader decides what to copy and checks the space; the node's ranks share the work
    work = NodeWork()
    dirs: list[str] = []  # the directories of the plan this run creates, shallowest first
    if lay.is_leader:
        try:
            mask = mode_mask(cfg.preserve_special_bits)
            work = _node_work(groups, manifest, dest, lay.local_size, mask)
            held = engine.settle(work.per_rank[0]) if engine is not None else 0
            unwanted = drop_partials(meta, _resumable(work, cfg.checksum))
            freed.files, freed.bytes = freed.files + unwanted.files, freed.bytes + unwanted.bytes
            usage = shutil.disk_usage(dest)
            if usage.total == 0 and not cfg.quiet:  # ramfs and the like report no capacity
                print(
                    f"datastore stage: note: {dest}: filesystem reports no capacity; "
                    "skipping the free-space check",
                    file=sys.stderr,
                )
            short = space_shortfall(dest, work.todo_bytes, usage.free + held, usage.total)
            if short:  # held: written already
                work.code, work.error = Exit.NO_SPACE, short
            else:
                _drop(
                    manifest,
                    dest,
                    _in_the_way(stale_files(manifest, trees, groups, limit), groups),
                    groups,
                )
                _make_dirs(dest, [i.dest for g in groups for i in g.items if i.kind == "dir"], dirs)
        except OSError as exc:  # (a DEST name: .datastore/tmp)
            where = os.path.join(dest, exc.filename or "")
            work.code, work.error = Exit.FAILED, f"{dest}: {exc.strerror}: {where}"
    work = node_comm.bcast(work, root=0)
    code, err = (Exit.FAILED, err) if err else (work.code, work.error)
    note = _freed_note(dest, freed) if lay.is_leader and freed.files else None
    status = comm.allgather((code, err, note, freed.bytes))
    log.notes([n for *_, n, _ in status if n])
    if any(code for code, *_ in status):
        if lock_fd is not None:  # refused here or on another node: leave nothing this run made
            if engine is not None:
                engine.settle([])
                engine.close()
                clean_tmp(meta)
            _unmake(dest, made, dirs[::-1])
        _close(lock_fd, meta)
        log.errors([e for _, e, *_ in status if e])
        return Agreed(max(code for code, *_ in status))

    # 4. copy
    mine = work.per_rank[lay.local_rank]
    total = sum(g.nbytes for g in mine)
    with Progress(total, enabled=log.progress, json_lines=log.progress_json) as bar:
        if mine and engine is None:
            engine = _engine(cfg, dest, lay.rank, policy, meta)
        if engine is not None:
            engine.on_bytes = bar.advance
        stats = engine.run(mine) if mine and engine is not None else Stats()
        if engine is not None:
            engine.close()

    # 5. the leader gives the directories their modes and times, clears the temp space and
    #    folds the node's journals into the manifest
    node_comm.Barrier()
    if lay.is_leader:
        stats.skipped, stats.skipped_bytes = work.skipped, work.skipped_bytes
        node_errors = (
            node_comm.allreduce(len(stats.errors)) if lay.local_size > 1 else len(stats.errors)
        )
        final = Manifest.load(dest, meta)
        final.shard = {"mode": cfg.mode, "node": lay.node, "nodes": lay.nodes}
        if not node_errors:
            for g in groups:
                if g.ident:
                    final.archives[g.source] = archive_record(g)
            stale = stale_files(final, trees, groups, limit)
            stats.errors.extend(_drop(final, dest, stale, groups))
        dir_items = [i for g in groups for i in g.items if i.kind == "dir"]  # after the drops
        stats.errors.extend(_settle_modes(dest, work.modes))
        stats.errors.extend(settle_dirs(dest, dir_items, cfg.preserve_special_bits))
        clean_tmp(meta)  # first: on a DEST out of inodes, the manifest needs one it frees
        if planned or not made:
            try:
                same_meta(dest, meta)  # (one swapped in: its manifest is not this DEST's)
                final.save(dest, meta)
            except OSError as exc:  # the journals still hold what was placed
                stats.errors.append(f"{dest}: cannot save the manifest: {exc.strerror}")
        if not planned:  # every source refused: leave nothing of DEST that this run made
            _unmake(dest, made)
        _close(lock_fd, meta)
    else:
        _close(meta)
        if lay.local_size > 1:
            node_comm.allreduce(len(stats.errors))
    elapsed = time.perf_counter() - t0

    # 6. summary on rank 0
    every = comm.gather(stats, root=0)
    code = Exit.FAILED if stats.errors else (Exit.BAD_INPUT if plan.errors else Exit.OK)
    code = comm.allreduce(code, op=_max_op(comm))
    if lay.rank == 0:
        log.summary(plan, every, elapsed, lay, sum(b for *_, b in status))
    return Agreed(code)


def space_shortfall(dest: str, need: int, free: int, total: int) -> str | None:
    """The error of a DEST whose ``free`` bytes cannot take the ``need`` bytes to copy;
    ``None`` where they fit, or the filesystem reports no capacity (``total`` 0: ramfs)."""
    if not total or need <= free:
        return None
    return f"{dest}: not enough space: need {human_bytes(need)}, {human_bytes(free)} available"


def locked_message(dest: str, template: str, lay: Layout) -> str:
    """The error of a DEST whose lock another stage holds: on several nodes with no
    ``{node}`` in DEST, maybe this run's other node (a DEST on a shared filesystem)."""
    msg = f"{dest}: another 'datastore stage' is writing to this destination"
    if lay.nodes > 1 and "{node}" not in template:
        msg += " (or another node of this run: on a shared filesystem, put {node} in DEST)"
    return msg


def whole_archives(manifest: Manifest) -> dict:
    """The archive records a plan may take instead of reading the archives again: none from a
    shard of several nodes, whose records list only that node's members (a plan from them left
    the other nodes' members out of the run)."""
    shard = manifest.shard or {}
    return {} if shard.get("mode") == "shard" and shard.get("nodes", 1) > 1 else manifest.archives


def trees_to_clean(plan: Plan, mode: str) -> list[tuple[str, str]]:
    """The sources whose earlier-staged files :func:`stale_files` may name, each with where it
    lands in DEST (its base name; ``""`` for an archive, unpacked into DEST): in replicate mode
    none when the plan met an error (a file the walk could not read is not a file gone:
    ``rsync --delete`` deletes nothing after an I/O error either; shard mode:
    :func:`planned_names`)."""
    if mode != "shard" and plan.errors:
        return []
    return [(g.source, "" if g.ident else os.path.basename(g.source)) for g in plan.groups]


def planned_names(plan: Plan, mode: str) -> set[str] | None:
    """Shard mode, a plan that met an error: the DEST names the plan has (on any node), the
    only ones :func:`stale_files` may name then (a file given to another node goes, a file the
    walk may have missed stays); ``None``: no such limit."""
    if mode != "shard" or not plan.errors:
        return None
    return {i.dest for g in plan.groups for i in g.items}


def stale_files(
    manifest: Manifest,
    trees: list[tuple[str, str]],
    groups: list[Group],
    limit: set[str] | None = None,
) -> list[str]:
    """The files an earlier run staged where the sources ``trees`` land that are not in this
    node's share now (``groups``), by DEST name: a file gone from the source (or staged there
    from another source: an earlier version of the dataset, staged from another path), or in
    shard mode one the new plan gives another node (the shares move when the sources change);
    only those in ``limit`` where given (:func:`planned_names`). Left in place, a training job
    would read samples the source does not have, and two nodes of a sharded store would hold
    the same file, one copy stale. Only files the manifest records are named."""
    mine = {i.dest for g in groups for i in g.items if i.kind != "dir"}
    return [
        key
        for key, entry in manifest.entries.items()
        if entry.get("kind") != "dir"
        and key not in mine
        and (limit is None or key in limit)
        and any(_lands(key, entry.get("source") or "", *tree) for tree in trees)
    ]


def _lands(key: str, source: str, root: str, name: str) -> bool:
    """Whether the DEST name ``key``, staged from ``source``, is where the source ``root``
    lands: under ``name`` (a file or tree; a file staged from inside it by another SRC, ``stage
    SRC/sub``, lands elsewhere), or a member of the archive ``root`` (``name`` empty)."""
    if not name:
        return source.startswith(f"{root}::")
    return key == name or key.startswith(f"{name}/")


def _in_the_way(keys: list[str], groups: list[Group]) -> list[str]:
    """Of the DEST names ``keys``, those where the new plan (``groups``) puts a directory, or
    beneath a name it gives a file (a file of the source become a directory, or the reverse)."""
    planned = {i.dest: i.kind == "dir" for g in groups for i in g.items}
    return [
        k
        for k in keys
        if planned.get(k) or any(planned.get(p) is False for p in _parents_outside(k, set()))
    ]


def _make_dirs(dest: str, rels: list[str], made: list[str]) -> None:
    """Make the directories ``rels`` of the plan in DEST, each through descriptors opened a
    name at a time from DEST (:func:`~staging.copy.open_beneath`), and let the owner write into
    them until the run gives them their modes (one staged read-only by an earlier run); the
    DEST names of those made are appended to ``made``, shallowest first. Checked by path, a
    directory swapped for a link between the check and the ``mkdir`` had it made outside."""
    for rel in rels:
        try:
            fd = open_beneath(dest, rel, make=True, made=made)
        except OSError as exc:  # named by the directory to make, a link on its way or not
            raise OSError(exc.errno, exc.strerror, os.path.join(dest, rel)) from None
        try:
            mode = stat.S_IMODE(os.fstat(fd).st_mode)
            if mode & 0o700 != 0o700:
                os.chmod(fd_path(fd), mode | 0o700)
        finally:
            os.close(fd)


def _settle_modes(dest: str, modes: list[tuple[str, int]]) -> list[str]:
    """Give files left in place their source's new mode (``chmod`` of the source since the
    last run: nothing copied, as ``rsync -a``), each through its directory opened beneath DEST
    and never through a link (by path, a directory swapped for one had the files it led to
    take the modes); the errors of those that cannot take it."""
    errors = []
    for rel, mode in modes:
        parent, name = os.path.split(rel)
        try:
            with opened_beneath(dest, parent) as dir_fd:
                _chmod_file(dir_fd, name, mode)
        except OSError as exc:
            errors.append(f"{os.path.join(dest, rel)}: cannot set mode {mode:o}: {exc.strerror}")
    return errors


def _chmod_file(dir_fd: int, name: str, mode: int) -> None:
    """``chmod`` the file ``name`` of the directory ``dir_fd``, never through a link (Python
    3.11 has no ``fchmodat(AT_SYMLINK_NOFOLLOW)`` on Linux)."""
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        if stat.S_ISLNK(os.fstat(fd).st_mode):
            raise OSError(errno.EPERM, "refusing to write through a symlink", name)
        os.chmod(fd_path(fd), mode)
    finally:
        os.close(fd)


def _drop(manifest: Manifest, dest: str, keys: list[str], groups: list[Group]) -> list[str]:
    """Remove the files ``keys`` (:func:`stale_files`) from DEST and the manifest, and their
    directories that the new share does not have once empty (one holding files of the user's
    stays), through descriptors opened beneath DEST (by path, a directory swapped for a link
    while the stage ran had the files it led to removed); the errors."""
    mine = {i.dest for g in groups for i in g.items if i.kind == "dir"}
    errors, dirs = [], set()
    for key in keys:
        dirs.update(_parents_outside(key, mine))
        try:
            _unlink_beneath(dest, key, key in mine)
        except (FileNotFoundError, NotADirectoryError):  # gone, or a file of the source now
            pass
        except OSError as exc:  # a link on the way included: the file is not ours to remove
            errors.append(
                f"{os.path.join(dest, key)}: cannot remove a file no longer in this share: "
                f"{exc.strerror}"
            )
            continue
        del manifest.entries[key]
    for key in sorted(dirs, key=lambda k: -k.count("/")):  # deepest first
        _rmdir_beneath(dest, key)
    return errors


def _unlink_beneath(dest: str, rel: str, planned_dir: bool) -> None:
    """Remove the file ``rel`` of DEST through its directory opened beneath DEST (a link on
    the way: ``EPERM``); nothing where the plan has a directory there and one stands there
    (its file went before the copy)."""
    parent, name = os.path.split(rel)
    with opened_beneath(dest, parent) as fd:
        if planned_dir and stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
            return
        os.unlink(name, dir_fd=fd)


def _rmdir_beneath(dest: str, rel: str) -> None:
    """Remove the directory ``rel`` of DEST through its parent opened beneath DEST, if it is
    empty; nothing where it is gone, not empty (files of the user's) or behind a link."""
    parent, name = os.path.split(rel)
    with contextlib.suppress(OSError), opened_beneath(dest, parent) as fd:
        os.rmdir(name, dir_fd=fd)


def _parents_outside(key: str, mine: set[str]) -> list[str]:
    """The directories of the DEST path ``key``, deepest first, up to the first in ``mine``."""
    parents = []
    while "/" in key:
        key = key.rsplit("/", 1)[0]
        if key in mine:
            break
        parents.append(key)
    return parents


def _resumable(work: NodeWork, algo: str) -> set[str]:
    """The first lines of the leaf logs of the partial copies this node's ranks would resume."""
    return {
        f"{i.source} {i.ident} {algo}"
        for groups in work.per_rank
        for g in groups
        for i in g.items
        if i.size > LEAF_BYTES
    }


def _freed_note(dest: str, freed: Freed) -> str:
    return (
        f"{dest}: removed {freed.files} temp file(s) that an interrupted or older stage left "
        f"in .datastore/tmp ({human_bytes(freed.bytes)} freed)"
    )


def _engine(cfg: StageConfig, dest: str, rank: int, policy: IoPolicy, meta: int | None) -> Engine:
    return Engine(
        dest, rank, cfg.checksum, cfg.streams, policy,
        special_bits=cfg.preserve_special_bits, confine=cfg.confine, meta=meta,
    )  # fmt: skip


def _open_meta(dest: str) -> tuple[int | None, str | None]:
    """DEST's ``.datastore`` open on a rank of its node other than the leader
    (:func:`~staging.manifest.open_meta`; the leader made it), or the error that refuses it (a
    link swapped in since the leader opened it raised inside the rank's Engine)."""
    try:
        return open_meta(dest), None
    except OSError as exc:
        return None, f"{dest}: cannot prepare destination ({exc.strerror})"


def _close(*fds: int | None) -> None:
    for fd in fds:
        if fd is not None:
            os.close(fd)


def _absent(path: str) -> list[str]:
    """``path`` and its ancestors that do not exist, deepest first."""
    missing = []
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def _unmake(dest: str, made: list[str], dirs: list[str] | None = None) -> None:
    """Remove the directories of the plan this run made in DEST (``dirs``, DEST names, through
    descriptors opened beneath it), then the lock, the temp directory and the directories this
    run made for DEST (``made``), each deepest first and only once it is empty: whatever
    another run put there meanwhile stays. A DEST that had ``.datastore`` (``made`` empty)
    keeps its lock, its manifest and its partial copies. ``made`` goes through descriptors
    opened beneath the directory that held the first of them (by path, a DEST swapped for a
    link had the lock, ``tmp`` and ``.datastore`` of the DEST it led to removed)."""
    for rel in dirs or ():  # (not made after all, or no longer empty: it stays)
        _rmdir_beneath(dest, rel)
    if not made:
        return
    top = os.path.dirname(made[-1]) or "."
    meta = os.path.relpath(meta_dir(dest), top)
    with contextlib.suppress(OSError):  # (gone, DEST a file, or a link on the way)
        _unlink_beneath(top, os.path.join(meta, "lock"), False)  # held: released when closed
    _rmdir_beneath(top, os.path.join(meta, "tmp"))
    for path in made:
        _rmdir_beneath(top, os.path.relpath(path, top))


def _node_groups(plan: Plan, mode: str, comm: Any, lay: Layout) -> list[Group]:
    """This node's groups on its leader (``[]`` on the other ranks): in shard mode rank 0
    scatters each node its share, so no rank receives the whole plan but rank 0; in
    replicate mode every node needs every group."""
    if lay.size == 1:
        return assign(plan, 1)[0] if mode == "shard" else plan.groups
    from mpi4py import MPI

    leaders = comm.Split(0 if lay.local_rank == 0 else MPI.UNDEFINED, lay.rank)
    if leaders == MPI.COMM_NULL:
        return []
    try:  # leaders are ordered by rank, as layout() numbers the nodes
        if mode == "shard":
            return leaders.scatter(assign(plan, lay.nodes) if lay.rank == 0 else None, root=0)
        return leaders.bcast(plan.groups if lay.rank == 0 else None, root=0)
    finally:
        leaders.Free()


def _max_op(comm: Any) -> Any:
    if comm.Get_size() == 1:
        return None
    from mpi4py import MPI

    return MPI.MAX


class _Log:
    """Messages to stderr (rank 0, unless ``--quiet``), the summary to stdout."""

    def __init__(self, cfg: StageConfig, lay: Layout):
        self.cfg, self.lay = cfg, lay
        self.progress = lay.rank == 0 and not cfg.quiet and not cfg.json and sys.stderr.isatty()
        self.progress_json = lay.rank == 0 and cfg.progress_json  # rank 0's share only

    def errors(self, errors: list[str]) -> None:
        if self.lay.rank == 0:
            for e in dict.fromkeys(errors):  # every node's, said once
                print(f"datastore stage: error: {e}", file=sys.stderr)

    def notes(self, notes: list[str]) -> None:
        if self.lay.rank == 0 and not self.cfg.quiet:
            for n in notes:
                print(f"datastore stage: note: {n}", file=sys.stderr)

    def summary(
        self, plan: Plan, every: list[Stats], elapsed: float, lay: Layout, freed: int
    ) -> None:
        total = Stats()
        for s in every:
            total.add(s)
        errors = list(dict.fromkeys(plan.errors + total.errors))  # every node's, said once
        doc = {
            "files": total.files,
            "bytes": total.bytes,
            "seconds": round(elapsed, 3),
            "mib_per_s": round(total.bytes / elapsed / MIB, 1) if elapsed > 0 else 0.0,
            "skipped": total.skipped,
            "skipped_bytes": total.skipped_bytes,
            "resumed_bytes": total.resumed_bytes,
            "tmp_freed_bytes": freed,
            "ranks": lay.size,
            "nodes": lay.nodes,
            "mode": self.cfg.mode,
            "errors": errors,
        }
        if self.cfg.json:
            print(json.dumps(doc))
            return
        for e in errors:
            print(f"datastore stage: error: {e}", file=sys.stderr)
        if self.cfg.quiet:
            return
        print(summary_line(doc))


def summary_line(doc: dict[str, Any]) -> str:
    """The summary for people, from the ``--json`` summary ``doc``."""
    line = (
        f"staged {doc['files']} files, {human_bytes(doc['bytes'])} in {doc['seconds']:.2f} s "
        f"({doc['mib_per_s']:.0f} MiB/s) on {doc['nodes']} node(s), {doc['ranks']} rank(s); "
        f"skipped {doc['skipped']} unchanged ({human_bytes(doc['skipped_bytes'])})"
    )
    if doc["resumed_bytes"]:
        line += f"; resumed {human_bytes(doc['resumed_bytes'])} of partial copies"
    if doc["errors"]:
        line += f"; {len(doc['errors'])} error(s)"
    return line
