"""An uncompressed tar's members are written while the walk over the archive goes on
(``Engine.ahead``), into hidden temp files, and placed only once the archive is known good and
its space counted: an archive refused late in its walk, or one that does not fit, leaves
nothing at DEST and nothing in ``DEST/.datastore``."""

from __future__ import annotations

import array
import errno
import fcntl
import io
import os
import shutil
import subprocess
import tarfile
import threading
from pathlib import Path

import pytest
from helpers import META, file_info, meta_listing, random_bytes, snapshot, tar_bytes

import staging.copy as copy
from staging import prefetch
from staging.checksum import LEAF_BYTES, combine, leaf_ranges, new_hasher
from staging.cluster import world
from staging.config import StageConfig
from staging.directio import IoPolicy
from staging.exitcodes import Exit
from staging.manifest import Manifest, meta_dir
from staging.plan import build_plan
from staging.stage import stage

KIB, MIB = 1024, 1024 * 1024
MEMBER = 256 * KIB
COUNT = 48  # 12 MiB: the walk hands extents of up to 8 MiB to the streams before it ends


def members(count: int = COUNT, size: int = MEMBER) -> list[tuple[str, bytes]]:
    return [(f"d/m{k:03d}.bin", random_bytes(size, seed=k)) for k in range(count)]


def write_tar(path: Path, files: list[tuple[str, bytes]], tail=()) -> Path:
    path.write_bytes(tar_bytes([(file_info(n), d) for n, d in files] + list(tail)))
    return path


def temp_files(dest: str | Path) -> list[str]:
    tmp = Path(meta_dir(str(dest))) / "tmp"
    return sorted(p.name for p in tmp.rglob("*") if p.is_file()) if tmp.exists() else []


@pytest.fixture
def ahead_seen(monkeypatch):
    """What DEST held when the walk had ended and every extent written ahead was finished:
    ``(temp files under .datastore/tmp, DEST's snapshot without .datastore)``."""
    seen: list[tuple[list[str], dict]] = []
    finish = copy.Engine._finish_ahead

    def look(self, **kw):
        finish(self, **kw)
        if not seen:
            seen.append((temp_files(self.dest), snapshot(Path(self.dest))))

    monkeypatch.setattr(copy.Engine, "_finish_ahead", look)
    return seen


@pytest.fixture
def tmpfs(tmp_path):
    """A tmpfs of its own: a filesystem whose archives the walk reads into memory of its own
    (``HeldReader``; on a local disk it reads their headers direct)."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=128M", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {(proc.stderr + proc.stdout).strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True, timeout=30)


def run_stage(dest: Path, *sources: Path) -> int:
    cfg = StageConfig(dest=str(dest), sources=tuple(map(str, sources)), quiet=True)
    return stage(cfg, world())


def test_members_written_ahead_stay_hidden_until_the_archive_is_settled(tmp_path):
    files = members()
    arc = write_tar(tmp_path / "x.tar", files)
    dest = str(tmp_path / "dest")
    os.makedirs(meta_dir(dest))
    engine = copy.Engine(dest, 0, "xxh3", 4, IoPolicy("auto", meta_dir(dest), log=False))
    plan = build_plan([str(arc)], ahead=engine.ahead)
    engine._finish_ahead()
    hidden = temp_files(dest)
    assert len(hidden) >= 31, hidden  # at least the first extent of 8 MiB, 31 members
    assert os.listdir(dest) == [META]  # nothing under a final name
    kept = engine.settle(plan.groups)
    assert kept == len(hidden) * MEMBER
    stats = engine.run(plan.groups)
    assert stats.errors == [] and (stats.files, stats.bytes) == (COUNT, COUNT * MEMBER)
    assert snapshot(Path(dest)) == {"d": ("dir",), **{n: ("file", d) for n, d in files}}
    entries = Manifest.load(dest).entries
    assert sorted(entries) == [n for n, _ in files]
    assert all(e["hash"].startswith("xxh3:") for e in entries.values())


def test_held_reader_serves_the_walk_and_the_members_it_holds(tmp_path, monkeypatch):
    monkeypatch.setattr(prefetch, "HELD_CHUNK", 4096)
    monkeypatch.setattr(prefetch, "HELD_WINDOW", 4 * 4096)  # chunks reused over 100,000 bytes
    data = os.urandom(100_000)
    (tmp_path / "f").write_bytes(data)
    with prefetch.HeldReader(str(tmp_path / "f")) as r:
        assert r.read(4096) == data[:4096]
        with r._cond:  # as a read ahead finishing, or a release, would now
            r._recycle()
        r.seek(4095)  # tarfile's look at the byte before a header, after a member of no data
        assert r.read(1) == data[4095:4096]
        first, last = r.hold(5000, 9000), r.hold(99_000, 1000)  # over 3 chunks; the last one
        assert r.seek(50_000) == 50_000  # the walk passes the first: its chunks stay
        assert r.read(7) == data[50_000:50_007]
        with r._cond:
            r._recycle()
        assert [len(v) for v in first.views()] == [3192, 4096, 1712]
        assert b"".join(first.views()) == data[5000:14000]
        first.release()
        assert r.seek(-5, io.SEEK_END) == 99_995
        assert r.read(100) == data[-5:] and r.read(1) == b""
    assert b"".join(last.views()) == data[99_000:]  # still there after the walk has ended
    last.release()


def test_members_read_with_the_walk_are_written_from_its_memory(tmp_path, tmpfs, monkeypatch):
    # chunks of 64 KiB: members of odd sizes lie across chunks; a window of 9 MiB (the
    # streams gather up to 8 MiB) makes the reader reuse its chunks over the 12 MiB archive
    monkeypatch.setattr(prefetch, "HELD_CHUNK", 64 * KIB)
    monkeypatch.setattr(prefetch, "HELD_WINDOW", 9 * MIB)
    files = [(f"d/m{k:03d}.bin", random_bytes(200 * KIB + 77 * k, seed=k)) for k in range(60)]
    files.append(("d/empty", b""))
    arc = write_tar(tmpfs / "x.tar", files)
    dest = str(tmp_path / "dest")
    os.makedirs(meta_dir(dest))
    engine = copy.Engine(dest, 0, "xxh3", 4, IoPolicy("auto", meta_dir(dest), log=False))
    plan = build_plan([str(arc)], ahead=engine.ahead)
    engine._finish_ahead()
    assert len(temp_files(dest)) == len(files)  # all, the last extent too
    assert os.listdir(dest) == [META]
    assert engine.settle(plan.groups) == sum(len(d) for _, d in files)
    stats = engine.run(plan.groups)
    assert stats.errors == [] and stats.files == len(files)
    assert snapshot(Path(dest)) == {"d": ("dir",), **{n: ("file", d) for n, d in files}}
    entries = Manifest.load(dest).entries
    for name, data in files:
        h = new_hasher("xxh3")
        h.update(data)
        assert entries[name]["hash"] == combine("xxh3", [h.digest()]), name


def test_the_temp_directory_asks_ext4_to_spread_its_subdirectories(tmp_path):
    """Each temp shard in a block group of its own: ext4 then passes over fewer inodes of
    files deleted in the last minutes for each temp file it creates (``_spread_subdirs``)."""
    dest = str(tmp_path / "dest")
    os.makedirs(meta_dir(dest))
    copy.Engine(dest, 0, "xxh3", 1, IoPolicy("auto", meta_dir(dest), log=False))
    fd = os.open(copy.tmp_dir(dest), os.O_RDONLY)
    try:
        flags = array.array("i", [0])
        fcntl.ioctl(fd, copy.FS_IOC_GETFLAGS, flags, True)
    except OSError as exc:
        pytest.skip(f"no inode flags on this filesystem: {exc}")
    finally:
        os.close(fd)
    assert flags[0] & copy.FS_TOPDIR_FL


def test_members_larger_than_the_walks_memory_stream_through_it(tmp_path, tmpfs, monkeypatch):
    monkeypatch.setattr(prefetch, "HELD_CHUNK", 64 * KIB)
    monkeypatch.setattr(prefetch, "HELD_WINDOW", 9 * MIB)
    files = [
        ("a.bin", random_bytes(100 * KIB, seed=1)),
        ("b.bin", random_bytes(9 * MIB + 3, seed=2)),  # more than one extent
        ("c.bin", random_bytes(LEAF_BYTES + 5 * MIB + 7, seed=3)),  # two leaves
        ("d.bin", random_bytes(10 * KIB, seed=4)),
    ]
    arc = write_tar(tmpfs / "x.tar", files)
    dest = str(tmp_path / "dest")
    os.makedirs(meta_dir(dest))
    engine = copy.Engine(dest, 0, "xxh3", 4, IoPolicy("auto", meta_dir(dest), log=False))
    plan = build_plan([str(arc)], ahead=engine.ahead)
    assert engine.settle(plan.groups) == sum(len(d) for _, d in files)  # all written ahead
    stats = engine.run(plan.groups)
    assert stats.errors == [] and stats.files == len(files)
    assert snapshot(Path(dest)) == {n: ("file", d) for n, d in files}
    entries = Manifest.load(dest).entries
    for name, data in files:
        leaves = []
        for off, n in leaf_ranges(len(data)):
            h = new_hasher("xxh3")
            h.update(data[off : off + n])
            leaves.append(h.digest())
        assert entries[name]["hash"] == combine("xxh3", leaves), name


def _hostile_last(tmp_path: Path) -> tuple[Path, str]:
    link = tarfile.TarInfo("zz")
    link.type, link.linkname = tarfile.SYMTYPE, "../../outside"
    arc = write_tar(tmp_path / "hostile.tar", members(), tail=[(link, None)])
    return arc, "member 'zz': symlink '../../outside' points outside DEST"


def _truncated_last(tmp_path: Path) -> tuple[Path, str]:
    raw = tar_bytes([(file_info(n), d) for n, d in members()])
    with tarfile.open(fileobj=__import__("io").BytesIO(raw)) as tf:
        last = tf.getmembers()[-1]
    (tmp_path / "cut.tar").write_bytes(raw[: last.offset_data + last.size // 2])
    return tmp_path / "cut.tar", f"member {last.name!r}: corrupt or truncated archive"


@pytest.mark.parametrize("where", ["local", "tmpfs"])
@pytest.mark.parametrize("make", [_hostile_last, _truncated_last], ids=["hostile", "truncated"])
def test_an_archive_refused_late_in_its_walk_leaves_nothing(
    tmp_path, ahead_seen, capsys, make, where, request
):
    arc, says = make(tmp_path if where == "local" else request.getfixturevalue("tmpfs"))
    good = tmp_path / "good.bin"
    good.write_bytes(b"staged anyway\n")
    dest = tmp_path / "box" / "dest"

    assert run_stage(dest, arc, good) == Exit.BAD_INPUT
    assert f"{arc}: {says}" in capsys.readouterr().err
    hidden, visible = ahead_seen[0]
    assert len(hidden) >= 31 and visible == {}  # written ahead, and hidden
    assert snapshot(dest) == {"good.bin": ("file", b"staged anyway\n")}
    assert meta_listing(dest) == {"manifest.json", "lock"}
    assert str(arc) not in (dest / META / "manifest.json").read_text()

    ahead_seen.clear()  # alone, the refused archive leaves not even the DEST it made
    assert run_stage(tmp_path / "box" / "new", arc) == Exit.BAD_INPUT
    assert len(ahead_seen[0][0]) >= 31
    assert os.listdir(tmp_path / "box") == ["dest"]


def test_an_archive_that_does_not_fit_leaves_nothing(tmp_path, ahead_seen, capsys):
    # 4 members of 3 MiB on a tmpfs of 8 MiB: the first two fit and are written ahead, the
    # other two are left to the copy, and the space check refuses the whole archive.
    arc = write_tar(tmp_path / "big.tar", members(4, 3 * MIB))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8M", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {(proc.stderr + proc.stdout).strip()}")
    try:
        assert run_stage(mnt / "dest", arc) == Exit.NO_SPACE
        err = capsys.readouterr().err
        assert f"{mnt / 'dest'}: not enough space: need 12.0 MiB, " in err, err
        hidden, visible = ahead_seen[0]
        assert len(hidden) == 2 and visible == {}
        assert os.listdir(mnt) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=True, timeout=30)


def test_held_bytes_past_the_archives_end_fail_instead_of_waiting(tmp_path, monkeypatch):
    # a truncated archive whose size is a whole number of chunks: the member held runs past
    # its end, where no chunk is ever read; its writer must fail, not wait forever
    monkeypatch.setattr(prefetch, "HELD_CHUNK", 4096)
    monkeypatch.setattr(prefetch, "HELD_WINDOW", 4 * 4096)
    (tmp_path / "f").write_bytes(os.urandom(2 * 4096))
    got: list[BaseException] = []

    def write(held: prefetch.Held) -> None:
        try:
            for _ in held.pieces():
                pass
        except OSError as exc:
            got.append(exc)
        finally:
            held.release()

    with prefetch.HeldReader(str(tmp_path / "f")) as r:
        held = r.hold(4096, 3 * 4096)
        writer = threading.Thread(target=write, args=(held,), daemon=True)
        writer.start()
        writer.join(10)
        assert not writer.is_alive(), "the writer waits for bytes past the archive's end"
    assert [e.errno for e in got] == [errno.EIO]


@pytest.mark.parametrize("where", ["local", "tmpfs"])
def test_a_member_dated_past_any_clock_is_refused_by_name(tmp_path, capsys, where, request):
    # a tar's base-256 mtime no filesystem can hold: written ahead before the archive is
    # checked, then refused with its name, not a traceback, and nothing left behind
    src = tmp_path if where == "local" else request.getfixturevalue("tmpfs")
    files = [
        (file_info(n, mtime=10**20 if k % 3 == 1 else 1_600_000_000), d)
        for k, (n, d) in enumerate(members(160))
    ]
    arc = src / "dated.tar"
    arc.write_bytes(tar_bytes(files))
    dest = tmp_path / "dest"

    assert run_stage(dest, arc) == Exit.BAD_INPUT
    says = "member 'd/m001.bin': modification time 100000000000000000000 out of range"
    assert f"{arc}: {says}" in capsys.readouterr().err
    assert not dest.exists()


@pytest.mark.parametrize("where", ["local", "tmpfs"])
def test_a_sparse_member_is_staged_and_its_truncation_named(tmp_path, capsys, where, request):
    # GNU tar's sparse member: its size counts its holes, its data in the archive far less
    if shutil.which("tar") is None:
        pytest.skip("no tar to write a sparse member")
    src = tmp_path if where == "local" else request.getfixturevalue("tmpfs")
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "a.bin").write_bytes(random_bytes(3 * MIB, seed=1))
    with open(tree / "sparse.bin", "wb") as f:
        f.truncate(16 * MIB)
        f.seek(10 * MIB)
        f.write(b"amid holes")
    arc = src / "sparse.tar"
    subprocess.run(
        ["tar", "--sparse", "-cf", str(arc), "-C", str(tree), "a.bin", "sparse.bin"],
        check=True,
        timeout=60,
    )
    assert arc.stat().st_size < 4 * MIB  # the holes are not in the archive

    assert run_stage(tmp_path / "dest", arc) == Exit.OK
    for name in ("a.bin", "sparse.bin"):
        assert (tmp_path / "dest" / name).read_bytes() == (tree / name).read_bytes()

    cut = src / "cut.tar"  # cut inside the sparse member's data
    cut.write_bytes(arc.read_bytes()[: 3 * MIB + 2048])
    assert run_stage(tmp_path / "cut", cut) == Exit.BAD_INPUT
    assert f"{cut}: corrupt or truncated archive" in capsys.readouterr().err
    assert not (tmp_path / "cut").exists()
