"""Temp files that an interrupted or older ``datastore stage`` left under ``DEST/.datastore/tmp``:
the next stage, holding DEST's lock, resumes the partial copies it can use (moved from an older
layout), removes everything else, and says what it freed; while another stage holds the lock,
nothing of it is touched.

The leftovers are made as the versions before 295b180 left them (read from
``git show c5ae921:staging/copy.py``): ``tmp/KK/KEY.part`` in 256 two-digit subdirectories
(before 50865c9: ``tmp/KEY.part``), ``KEY`` the first 20 hex digits of the SHA-1 of the DEST
name (and ``\\0offset`` for a tar member written ahead), and beside the temp file of a file
larger than one leaf, cut to its size, the leaf log ``KEY.leaves``: ``source ident algo``, then
``index digest`` for each leaf written."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from helpers import file_info, random_bytes, run_stage, snapshot, tar_bytes

import staging.copy as copy
from staging.checksum import LEAF_BYTES, leaf_ranges, new_hasher
from staging.cluster import Layout, world
from staging.config import StageConfig
from staging.directio import IoPolicy
from staging.exitcodes import Exit
from staging.manifest import lock_dest, meta_dir
from staging.plan import Item, build_plan
from staging.progress import human_bytes
from staging.stage import locked_message, stage

KIB = 1024
BIG = LEAF_BYTES + 300_001  # two leaves: copied by leaves, with a leaf log


def old_temp(dest: Path, name: str, layout: str, offset: int | None = None) -> Path:
    """Where a version of ``layout`` put the temp file of DEST name ``name`` (``offset``: a tar
    member written ahead)."""
    raw = os.fsencode(name) + (b"\0%d" % offset if offset is not None else b"")
    key = hashlib.sha1(raw).hexdigest()[:20]
    tmp = Path(copy.tmp_dir(str(dest)))
    path = tmp / (key[:2] if layout == "c5ae921" else "") / f"{key}.part"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def leave_partial(part: Path, item: Item, data: bytes, leaves: int) -> None:
    """What ``_copy_large`` left when killed after writing ``leaves`` leaves of ``item``."""
    with open(part, "wb") as f:
        f.truncate(item.size)
        f.write(data[: leaves * LEAF_BYTES])
    lines = [f"{item.source} {item.ident} xxh3"]
    for i, (off, n) in enumerate(leaf_ranges(item.size)[:leaves]):
        h = new_hasher("xxh3")
        h.update(data[off : off + n])
        lines.append(f"{i} {h.digest().hex()}")
    part.with_suffix(".leaves").write_text("\n".join(lines) + "\n")


def blocks(*paths: Path) -> int:
    """The disk space that removing ``paths`` frees."""
    return sum(os.lstat(p).st_blocks * 512 for p in paths)


def freed_line(dest: Path, files: int, nbytes: int) -> str:
    return (
        f"datastore stage: note: {dest}: removed {files} temp file(s) that an interrupted or "
        f"older stage left in .datastore/tmp ({human_bytes(nbytes)} freed)"
    )


def only_item(src: Path) -> Item:
    (item,) = build_plan([str(src)]).groups[0].items
    return item


@pytest.mark.parametrize("layout", ["c5ae921", "flat"])
def test_an_older_versions_partial_copy_is_resumed_and_its_debris_removed(tmp_path, layout):
    data = random_bytes(BIG, seed=1)
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    dest = tmp_path / "dest"
    os.makedirs(meta_dir(str(dest)))
    os.close(lock_dest(str(dest)))  # the old version's lock, released
    item = only_item(src)
    leave_partial(old_temp(dest, item.dest, layout), item, data, leaves=1)
    debris = [old_temp(dest, "small.bin", layout), old_temp(dest, "t/m.bin", layout, offset=512)]
    debris[0].write_bytes(random_bytes(5000, seed=2))  # copied, never committed
    debris[1].write_bytes(random_bytes(70 * KIB, seed=3))  # written ahead of its tar's walk
    freed = blocks(*debris)

    proc = run_stage(src, "--to", dest, "--json", check=0)
    doc = json.loads(proc.stdout)
    assert (doc["files"], doc["bytes"], doc["resumed_bytes"]) == (1, BIG, LEAF_BYTES)
    assert doc["tmp_freed_bytes"] == freed
    assert proc.stderr.splitlines() == [freed_line(dest, 2, freed)]
    assert snapshot(dest) == {"big.bin": ("file", data)}
    assert sorted(os.listdir(meta_dir(str(dest)))) == ["lock", "manifest.json"]


def test_partial_copies_this_run_cannot_resume_are_removed(tmp_path):
    data = random_bytes(BIG, seed=4)
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    dest = tmp_path / "dest"
    os.makedirs(meta_dir(str(dest)))
    stale = only_item(src)
    old_temps = [old_temp(dest, stale.dest, "c5ae921"), old_temp(dest, "gone.bin", "c5ae921")]
    leave_partial(old_temps[0], stale, data, leaves=1)
    os.utime(src, ns=(0, stale.mtime_ns + 10**9))  # changed since: its leaves no longer count
    gone = tmp_path / "gone.bin"  # staged before, not this time
    gone.write_bytes(data)
    leave_partial(old_temps[1], only_item(gone), data, leaves=1)
    user = tmp_path / "user"  # a link planted in tmp/: removed, never followed
    user.mkdir()
    (user / "keep.bin").write_bytes(b"mine")
    os.symlink(user, Path(copy.tmp_dir(str(dest))) / "ab")
    left = [p.with_suffix(x) for p in old_temps for x in (".part", ".leaves")]
    freed = blocks(*left)

    proc = run_stage(src, "--to", dest, "--json", check=0)
    doc = json.loads(proc.stdout)
    assert (doc["files"], doc["bytes"], doc["resumed_bytes"]) == (1, BIG, 0)
    assert doc["tmp_freed_bytes"] == freed and freed > 2 * LEAF_BYTES
    assert proc.stderr.splitlines() == [freed_line(dest, 5, freed)]
    assert snapshot(dest) == {"big.bin": ("file", data)}
    assert sorted(os.listdir(meta_dir(str(dest)))) == ["lock", "manifest.json"]
    assert snapshot(user) == {"keep.bin": ("file", b"mine")}


def test_a_stage_holding_the_lock_keeps_its_temp_files(tmp_path):
    src = tmp_path / "f.bin"
    src.write_bytes(b"x" * 1000)
    dest = tmp_path / "dest"
    os.makedirs(meta_dir(str(dest)))
    part = old_temp(dest, "small.bin", "c5ae921")
    part.write_bytes(b"being written")
    fd = lock_dest(str(dest))  # a live stage of this DEST
    try:
        proc = run_stage(src, "--to", dest, check=1)
    finally:
        os.close(fd)
    assert "another 'datastore stage' is writing to this destination" in proc.stderr
    assert part.read_bytes() == b"being written"
    assert sorted(os.listdir(dest)) == [".datastore"]


@pytest.mark.parametrize("layout", ["current", "c5ae921"])
def test_an_interrupted_tar_stages_members_written_ahead_are_removed(tmp_path, capsys, layout):
    files = [(f"d/m{k:02d}.bin", random_bytes(256 * KIB, seed=k)) for k in range(24)]
    arc = tmp_path / "x.tar"
    arc.write_bytes(tar_bytes([(file_info(n), d) for n, d in files]))
    dest = str(tmp_path / "dest")
    os.makedirs(meta_dir(dest))
    # the walk writes members ahead into hidden temp files; the stage dies before settling them
    engine = copy.Engine(dest, 0, "xxh3", 4, IoPolicy("auto", meta_dir(dest), log=False))
    build_plan([str(arc)], ahead=engine.ahead)
    engine._finish_ahead()
    tmp = Path(copy.tmp_dir(dest))
    left = sorted(p for p in tmp.rglob("*.part"))
    assert len(left) == len(files), left
    if layout == "c5ae921":  # where that version wrote them
        for p in left:
            (tmp / p.name[:2]).mkdir(exist_ok=True)
            p.rename(tmp / p.name[:2] / p.name)
        left = sorted(tmp.rglob("*.part"))
    freed = blocks(*left)

    cfg = StageConfig(dest=dest, sources=(str(arc),), json=True)
    assert stage(cfg, world()) == Exit.OK
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert (doc["files"], doc["bytes"], doc["tmp_freed_bytes"]) == (
        len(files),
        len(files) * 256 * KIB,
        freed,
    )
    assert err.splitlines() == [freed_line(Path(dest), len(files), freed)]
    assert snapshot(Path(dest)) == {"d": ("dir",), **{n: ("file", d) for n, d in files}}
    assert sorted(os.listdir(meta_dir(dest))) == ["lock", "manifest.json"]


def test_a_lock_held_on_several_nodes_without_node_in_dest_hints_at_a_shared_dest():
    """Two nodes of one run sharing DEST (on a shared filesystem, no ``{node}``) met each
    other's lock and said only "another 'datastore stage' is writing", with none running."""
    held = "/s/d: another 'datastore stage' is writing to this destination"
    hint = " (or another node of this run: on a shared filesystem, put {node} in DEST)"
    two, one = Layout(1, 2, 1, 2, 0, 1), Layout(0, 2, 0, 1, 0, 2)
    assert locked_message("/s/d", "/s/d", two) == held + hint
    assert locked_message("/s/d", "/s/d", one) == held
    assert locked_message("/s/d", "/s/{node}", two) == held
