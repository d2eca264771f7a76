"""End-to-end tests of ``datastore stage``: the real CLI in a subprocess, real files, no mocks."""

from __future__ import annotations

import errno
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import xxhash
import zstandard
from helpers import (
    BASE_MTIME_NS,
    META,
    ROOT,
    TREE_EMPTY_DIRS,
    TREE_FILES,
    ctrl_c_heard,
    dir_info,
    file_info,
    link_info,
    meta_listing,
    random_bytes,
    slow_file,
    snapshot,
    tar_bytes,
    tree_bytes,
    write_archive,
)

import staging.verify
from staging.cluster import LAUNCH_ENV, Layout, world
from staging.config import StageConfig
from staging.copy import Stats
from staging.dryrun import dry_run
from staging.exitcodes import Exit
from staging.plan import Plan
from staging.progress import MIB, bar_columns
from staging.stage import _Log, stage, summary_line
from staging.verify import REPAIR

LEAF = 32 * 1024 * 1024  # the leaf size documented in staging/checksum.py
N_TREE = len(TREE_FILES)
TREE_TOTAL = sum(size for _, size, _ in TREE_FILES)
ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.zst")


# -- helpers local to this module -------------------------------------------------------------
def expected_digest(data: bytes, algo: str = "xxh3") -> str:
    """The chunk-tree digest, computed independently of ``staging.checksum``: one digest per
    32 MiB leaf (an empty file has one empty leaf), then the hash of the concatenated digests."""

    def new():
        return xxhash.xxh3_128() if algo == "xxh3" else hashlib.blake2b(digest_size=16)

    view = memoryview(data)
    leaves = [view[o : o + LEAF] for o in range(0, len(data), LEAF)] or [view[:0]]
    top = new()
    for leaf in leaves:
        h = new()
        h.update(leaf)
        top.update(h.digest())
    return f"{algo}:{top.hexdigest()}"


def manifest(dest: Path) -> dict:
    return json.loads((dest / META / "manifest.json").read_text())


def summary(proc: subprocess.CompletedProcess[str]) -> dict:
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    return json.loads(lines[0])


def assert_clean_meta(dest: Path) -> None:
    """After a successful run only the manifest and the lock file remain in DEST/.datastore."""
    assert meta_listing(dest) == {"manifest.json", "lock"}


def assert_clean_stderr(proc: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in proc.stderr
    assert "internal error" not in proc.stderr


def prefixed(snap: dict[str, tuple], prefix: str) -> dict[str, tuple]:
    """A source snapshot as it should appear under DEST/prefix (the prefix itself a dir)."""
    return {prefix: ("dir",), **{f"{prefix}/{rel}": v for rel, v in snap.items()}}


def archive_tree(root: Path, make_tree) -> Path:
    """The standard tree plus a relative symlink inside it and a hardlink to one of its files."""
    make_tree(root, seed=7)
    (root / "links").mkdir()
    os.symlink("../a/small.txt", root / "links" / "rel")
    os.link(root / "a" / "page.bin", root / "zz_hard.bin")  # after a/ in tar order
    return root


def make_archive(tree: Path, out: Path) -> Path:
    """Pack ``tree`` with ``tarfile`` (members named ``./...``), compressed per ``out``'s name."""
    raw = out.with_name(out.name + ".raw.tar")
    with tarfile.open(raw, "w") as tf:
        tf.add(tree, arcname=".")
    write_archive(out, raw.read_bytes())
    raw.unlink()
    return out


# -- round trips ------------------------------------------------------------------------------
def test_directory_round_trip(tmp_path, run_stage, make_tree):
    src = make_tree(tmp_path / "src")
    dest = tmp_path / "dest"
    proc = run_stage(src, "--to", dest, "--json", check=0)
    assert_clean_stderr(proc)
    doc = summary(proc)
    assert (doc["files"], doc["bytes"], doc["skipped"], doc["errors"]) == (
        N_TREE,
        TREE_TOTAL,
        0,
        [],
    )
    assert snapshot(dest) == prefixed(snapshot(src), "src")
    for rel in TREE_EMPTY_DIRS:
        assert (dest / "src" / rel).is_dir()
        assert os.listdir(dest / "src" / rel) == []
    assert (dest / "src" / "empty.txt").stat().st_size == 0
    assert_clean_meta(dest)


def test_single_file_source(tmp_path, run_stage):
    data = random_bytes(123_457, seed=11)
    src = tmp_path / "blob.bin"
    src.write_bytes(data)
    dest = tmp_path / "dest"
    proc = run_stage(src, "--to", dest, "--json", check=0)
    assert summary(proc)["files"] == 1
    assert snapshot(dest) == {"blob.bin": ("file", data)}
    assert_clean_meta(dest)


def test_multiple_sources(tmp_path, run_stage, make_tree):
    one = make_tree(tmp_path / "in" / "one", seed=1)
    two = make_tree(tmp_path / "in" / "two", seed=2)
    single = tmp_path / "in" / "single.dat"
    single.write_bytes(random_bytes(5000, seed=3))
    dest = tmp_path / "dest"
    proc = run_stage(one, two, single, "--to", dest, "--json", check=0)
    assert summary(proc)["files"] == 2 * N_TREE + 1
    expected = {
        **prefixed(snapshot(one), "one"),
        **prefixed(snapshot(two), "two"),
        "single.dat": ("file", single.read_bytes()),
    }
    assert snapshot(dest) == expected
    assert tree_bytes(dest)["one/a/small.txt"] != tree_bytes(dest)["two/a/small.txt"]


def test_modes_and_mtimes_preserved(tmp_path, run_stage, make_tree):
    src = make_tree(tmp_path / "src")
    single = tmp_path / "single.sh"
    single.write_bytes(b"#!/bin/sh\necho hi\n")
    single.chmod(0o750)
    os.utime(single, ns=(1_500_000_000_987_654_321, 1_500_000_000_987_654_321))
    dest = tmp_path / "dest"
    run_stage(src, single, "--to", dest, "-q", check=0)
    pairs = [(src / rel, dest / "src" / rel) for rel, _, _ in TREE_FILES]
    pairs.append((single, dest / "single.sh"))
    for s, d in pairs:
        ss, ds = s.stat(), d.stat()
        assert stat.S_IMODE(ds.st_mode) == stat.S_IMODE(ss.st_mode), d
        assert ds.st_mtime_ns == ss.st_mtime_ns, d
    modes = {stat.S_IMODE((dest / "src" / rel).stat().st_mode) for rel, _, _ in TREE_FILES}
    assert modes == {mode for _, _, mode in TREE_FILES}


def dir_attrs(root: Path) -> dict[str, tuple[int, int]]:
    """``{relative path: (mode, mtime_ns)}`` of ``root`` and the directories under it."""
    paths = [root, *(p for p in root.rglob("*") if p.is_dir() and META not in p.parts)]
    return {str(p.relative_to(root)): (stat.S_IMODE(p.stat().st_mode), p.stat().st_mtime_ns)
            for p in paths}  # fmt: skip


def test_directory_modes_and_mtimes_preserved(tmp_path, run_stage):
    """As with ``cp -a`` and ``tar -xf``: a private directory stays private and every directory
    keeps its mtime (they used to get the umask's mode and the time of the copy), setgid
    dropped as a file's is; a re-run still writes into a directory staged read-only."""
    src = tmp_path / "src"
    modes = {"priv": 0o700, "ro": 0o500, "ro/sub": 0o750, "sgid": 0o2755, ".": 0o751}
    for rel in modes:
        (src / rel).mkdir(parents=True, exist_ok=True)
        (src / rel / "f").write_bytes(rel.encode())
    for k, rel in enumerate(sorted(modes, key=lambda r: -len(r))):  # deepest first
        (src / rel).chmod(modes[rel])
        os.utime(src / rel, ns=(BASE_MTIME_NS + k, BASE_MTIME_NS + k))
    member = dir_info("adir")
    member.mode, member.mtime = 0o700, 1_500_000_000
    arc = write_archive(
        tmp_path / "a.tar.gz", tar_bytes([(member, None), (file_info("adir/x"), b"x")])
    )
    dest = tmp_path / "dest"
    want = {rel: (mode & 0o777, t) for rel, (mode, t) in dir_attrs(src).items()}
    want["adir"] = (0o700, 1_500_000_000 * 10**9)
    for _ in range(2):
        run_stage(src, arc, "--to", dest, "-q", check=0)
        got = dir_attrs(dest / "src") | {"adir": dir_attrs(dest)["adir"]}
        assert got == want
        (src / "ro" / "f").write_bytes(b"changed")  # re-copied into the 0500 directory
        os.utime(src / "ro", ns=(want["ro"][1], want["ro"][1]))
    assert (dest / "src" / "ro" / "f").read_bytes() == b"changed"


@pytest.mark.parametrize("keep", [False, True])
def test_setuid_setgid_sticky_dropped_unless_asked(tmp_path, run_stage, keep):
    """A setuid program in a source tree or an archive never becomes one in DEST by default."""
    src = tmp_path / "src"
    src.mkdir()
    prog = src / "prog"
    prog.write_bytes(b"#!/bin/sh\n")
    prog.chmod(0o4755)
    sticky = src / "sticky"
    sticky.write_bytes(b"x")
    sticky.chmod(0o1644)
    archive = write_archive(
        tmp_path / "bits.tar",
        tar_bytes([(file_info("suid", mode=0o4755), b"a"), (file_info("sgid", mode=0o2750), b"b")]),
    )
    dest = tmp_path / "dest"
    flag = ["--preserve-special-bits"] if keep else []
    run_stage(src, archive, "--to", dest, "-q", *flag, check=0)
    got = {
        name: stat.S_IMODE((dest / path).stat().st_mode)
        for name, path in (("prog", "src/prog"), ("sticky", "src/sticky"), ("suid", "suid"),
                           ("sgid", "sgid"))
    }  # fmt: skip
    if keep:
        assert got == {"prog": 0o4755, "sticky": 0o1644, "suid": 0o4755, "sgid": 0o2750}
    else:
        assert got == {"prog": 0o755, "sticky": 0o644, "suid": 0o755, "sgid": 0o750}


def test_confine_keeps_reads_beneath_the_roots(tmp_path, run_stage):
    root = tmp_path / "root"
    (root / "tree").mkdir(parents=True)
    (root / "tree" / "a").write_text("a")
    outside = tmp_path / "outside.txt"
    outside.write_text("outside")
    (root / "tree" / "out").symlink_to(outside)
    open_dest = tmp_path / "open"
    run_stage(root / "tree", "--to", open_dest, "-q", check=0)  # no --confine: links followed
    assert (open_dest / "tree" / "out").read_text() == "outside"
    dest = tmp_path / "dest"
    r = run_stage(root / "tree", outside, "--to", dest, "--confine", root, check=2)
    assert "tree/out: a symlink out of the allowed roots, skipped" in r.stderr
    assert "outside.txt: outside the allowed roots, skipped" in r.stderr
    assert (dest / "tree" / "a").read_text() == "a"
    assert not (dest / "tree" / "out").exists() and not (dest / "outside.txt").exists()


def test_confine_refuses_a_dest_that_leads_out_of_the_roots(tmp_path):
    """A DEST under the roots when the service checked it, swapped for a link out before its
    stage started (a Python start-up later), was written: a planted note.txt landed in the
    service user's home."""
    from staging.cluster import SoloComm
    from staging.config import StageConfig
    from staging.stage import stage

    root, home = tmp_path / "root", tmp_path / "home"
    (root / "src").mkdir(parents=True)
    (root / "src" / "note.txt").write_text("planted")
    home.mkdir()
    (root / "dst").symlink_to(home)
    cfg = StageConfig(
        dest=str(root / "dst"), sources=(str(root / "src"),), confine=(str(root),), quiet=True
    )
    assert stage(cfg, SoloComm()) == 1
    assert list(home.iterdir()) == []


def test_a_symlink_loop_is_an_error_not_a_copy_without_end(tmp_path, run_stage):
    """A link back to a directory on its own path is named and skipped; the rest is staged
    once (``selfdir -> .`` used to write 40 nested copies, and two loops never ended)."""
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_bytes(b"a\n")
    (src / "sub" / "b.txt").write_bytes(b"b\n")
    (src / "selfdir").symlink_to(".")
    (src / "sub" / "up").symlink_to("..")
    (src / "alias").symlink_to("sub")  # a link that is no loop is followed, as before
    dest = tmp_path / "dest"
    for args in (["--dry-run"], []):
        proc = run_stage(src, "--to", dest, *args, check=2, timeout=30)
        for link in ("selfdir", "sub/up"):
            assert f"{src / link}: a symlink loop (leads back to a directory" in proc.stderr
    assert snapshot(dest) == {
        "src": ("dir",), "src/a.txt": ("file", b"a\n"), "src/sub": ("dir",),
        "src/sub/b.txt": ("file", b"b\n"), "src/alias": ("dir",),
        "src/alias/b.txt": ("file", b"b\n"),
    }  # fmt: skip


# -- archives ---------------------------------------------------------------------------------
@pytest.mark.parametrize("suffix", ARCHIVE_SUFFIXES)
def test_archive_unpacked_byte_for_byte(tmp_path, run_stage, make_tree, suffix):
    tree = archive_tree(tmp_path / "tree", make_tree)
    arc = make_archive(tree, tmp_path / f"data{suffix}")
    # the archive really holds the member kinds this test is about
    raw = tar_of(arc)
    with tarfile.open(fileobj=raw) as tf:
        infos = {i.name: i for i in tf.getmembers()}
    assert infos["./links/rel"].issym() and infos["./links/rel"].linkname == "../a/small.txt"
    assert infos["./zz_hard.bin"].islnk() and infos["./zz_hard.bin"].linkname == "./a/page.bin"
    assert infos["./emptydir"].isdir()

    dest = tmp_path / "dest"
    proc = run_stage(arc, "--to", dest, "--json", check=0)
    assert_clean_stderr(proc)
    doc = summary(proc)
    # regular files, the hardlink (a copy) and the symlink
    assert doc["files"] == N_TREE + 2
    assert doc["bytes"] == TREE_TOTAL + 4096
    assert snapshot(dest) == snapshot(tree)
    assert os.readlink(dest / "links" / "rel") == "../a/small.txt"
    assert (dest / "links" / "rel").read_bytes() == (tree / "a" / "small.txt").read_bytes()
    assert (dest / "zz_hard.bin").read_bytes() == (tree / "a" / "page.bin").read_bytes()
    assert not (dest / "zz_hard.bin").is_symlink()
    for rel, _, _ in TREE_FILES:  # tar keeps whole seconds
        assert (dest / rel).stat().st_mtime_ns // 10**9 == (tree / rel).stat().st_mtime_ns // 10**9

    entries = manifest(dest)["entries"]
    files = {rel for rel, _, _ in TREE_FILES} | {"zz_hard.bin"}
    assert set(entries) == files | {"links/rel"}
    for rel in files:
        e = entries[rel]
        data = (tree / rel).read_bytes()
        assert (e["kind"], e["size"], e["hash"]) == ("file", len(data), expected_digest(data))
        assert e["source"] == f"{arc}::{rel}"
    assert entries["links/rel"]["kind"] == "symlink"
    assert entries["links/rel"]["link"] == "../a/small.txt"
    assert_clean_meta(dest)


def tar_of(arc: Path) -> io.BytesIO:
    """The uncompressed tar stream of an archive file, as a seekable file object."""
    data = arc.read_bytes()
    if arc.name.endswith((".gz", ".tgz")):
        data = gzip.decompress(data)
    elif arc.name.endswith(".zst"):
        data = zstandard.ZstdDecompressor().decompressobj().decompress(data)
    return io.BytesIO(data)


@pytest.mark.parametrize("suffix", [".tar", ".tar.gz", ".tar.zst"])
def test_archive_duplicate_member_last_wins(tmp_path, run_stage, suffix):
    """Tar semantics: of two members with one name, the later one is what extraction leaves."""
    first = random_bytes(50_000, seed=21)
    last = b"the second, shorter version\n"
    raw = tar_bytes(
        [
            (file_info("dup.bin"), first),
            (file_info("other.txt"), b"other\n"),
            (file_info("dup.bin", mtime=1_600_000_100), last),
        ]
    )
    arc = write_archive(tmp_path / f"dups{suffix}", raw)
    dest = tmp_path / "dest"
    proc = run_stage(arc, "--to", dest, "--json", check=0)
    assert_clean_stderr(proc)
    doc = summary(proc)
    assert (doc["files"], doc["bytes"], doc["errors"]) == (2, len(last) + 6, [])
    assert snapshot(dest) == {"dup.bin": ("file", last), "other.txt": ("file", b"other\n")}
    assert manifest(dest)["entries"]["dup.bin"]["hash"] == expected_digest(last)
    assert_clean_meta(dest)


@pytest.mark.parametrize("suffix", [".tar", ".tar.gz", ".tar.zst"])
def test_archive_hardlinks_copy_their_target_as_tar_leaves_it(tmp_path, run_stage, suffix):
    """A hardlink gets its target's bytes as they were when it came (a later member of the
    target's name replaces the target, not the link), through a chain of hardlinks too, as
    ``tar -xf`` leaves them. A compressed archive used to copy the links after the stream from
    DEST: ``h.txt`` got the later bytes, and ``h2 -> h1 -> f`` failed (h1 not placed yet)."""
    raw = tar_bytes(
        [
            (file_info("f.txt"), b"first"),
            (link_info("h.txt", "f.txt", hard=True), None),
            (link_info("h1", "f.txt", hard=True), None),
            (link_info("h2", "h1", hard=True), None),
            (file_info("f.txt", mtime=1_600_000_100), b"second!"),
        ]
    )
    arc = write_archive(tmp_path / f"links{suffix}", raw)
    dest = tmp_path / "dest"
    proc = run_stage(arc, "--to", dest, "--json", check=0)
    assert_clean_stderr(proc)
    assert summary(proc)["files"] == 4
    assert snapshot(dest) == {
        "f.txt": ("file", b"second!"), "h.txt": ("file", b"first"),
        "h1": ("file", b"first"), "h2": ("file", b"first"),
    }  # fmt: skip
    assert manifest(dest)["entries"]["h2"]["hash"] == expected_digest(b"first")
    assert_clean_meta(dest)
    run_stage("--verify", "--to", dest, check=0)
    # an older version's record of the archive (h.txt a "hardlink" row) is not reused to plan
    doc = manifest(dest)
    row = next(r for r in doc["archives"][str(arc)]["items"] if r[0] == "h.txt")
    row[1:3], row[5:7] = ["hardlink", 0], [1, "f.txt"]  # kind, size; offset, link
    (dest / META / "manifest.json").write_text(json.dumps(doc))
    (dest / "h.txt").unlink()
    run_stage(arc, "--to", dest, check=0)
    assert (dest / "h.txt").read_bytes() == b"first"


@pytest.mark.parametrize("suffix", [".tar", ".tar.zst"])
def test_no_unpack_copies_archive_itself(tmp_path, run_stage, make_tree, suffix):
    tree = archive_tree(tmp_path / "tree", make_tree)
    arc = make_archive(tree, tmp_path / f"data{suffix}")
    dest = tmp_path / "dest"
    proc = run_stage(arc, "--to", dest, "--no-unpack", "--json", check=0)
    assert summary(proc)["files"] == 1
    assert snapshot(dest) == {arc.name: ("file", arc.read_bytes())}
    e = manifest(dest)["entries"][arc.name]
    assert (e["source"], e["size"]) == (str(arc), arc.stat().st_size)
    assert e["hash"] == expected_digest(arc.read_bytes())


# -- manifest and checksums -------------------------------------------------------------------
def test_manifest_entries_and_hashes(tmp_path, run_stage, make_tree):
    src = make_tree(tmp_path / "src")
    dest = tmp_path / "dest"
    run_stage(src, "--to", dest, "-q", check=0)
    doc = manifest(dest)
    assert doc["leaf_bytes"] == LEAF
    assert set(doc["entries"]) == {f"src/{rel}" for rel, _, _ in TREE_FILES}
    for rel, size, _ in TREE_FILES:
        e = doc["entries"][f"src/{rel}"]
        data = (src / rel).read_bytes()
        assert e["kind"] == "file"
        assert e["size"] == size
        assert e["source"] == str(src / rel)
        assert re.fullmatch(r"xxh3:[0-9a-f]{32}", e["hash"]), e["hash"]
        assert e["hash"] == expected_digest(data), rel


def test_large_file_leaves_and_verify(tmp_path, run_stage):
    """One file over a 32 MiB leaf: copied leaf-parallel, digest of leaf digests, verified."""
    size = 70 * 1024 * 1024 + 12_345  # three leaves: 32 MiB, 32 MiB, the rest
    data = random_bytes(size, seed=99)
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    dest = tmp_path / "dest"
    proc = run_stage(src, "--to", dest, "--json", check=0)
    assert summary(proc)["bytes"] == size
    staged = dest / "big.bin"
    assert staged.stat().st_size == size
    assert staged.read_bytes() == data
    entry = manifest(dest)["entries"]["big.bin"]
    assert entry["size"] == size
    want = expected_digest(data)
    assert want != f"xxh3:{xxhash.xxh3_128(data).hexdigest()}"  # the leaves matter
    assert entry["hash"] == want
    assert_clean_meta(dest)  # no .part or .leaves left in tmp/

    run_stage("--verify", "--to", dest, check=0)
    with open(staged, "r+b") as f:  # one byte in the last leaf
        f.seek(2 * LEAF + 77)
        b = f.read(1)
        f.seek(2 * LEAF + 77)
        f.write(bytes([b[0] ^ 0x01]))
    proc = run_stage("--verify", "--to", dest, check=4)
    assert proc.stderr.splitlines() == [
        f"datastore stage: verify: {dest}: checksum mismatch: big.bin",
        REPAIR,
    ]


def test_blake2b_checksum(tmp_path, run_stage, make_tree):
    src = make_tree(tmp_path / "src")
    dest = tmp_path / "dest"
    run_stage(src, "--to", dest, "--checksum", "blake2b", "-q", check=0)
    entries = manifest(dest)["entries"]
    assert len(entries) == N_TREE
    for rel, _, _ in TREE_FILES:
        h = entries[f"src/{rel}"]["hash"]
        assert re.fullmatch(r"blake2b:[0-9a-f]{32}", h), h
        assert h == expected_digest((src / rel).read_bytes(), "blake2b")
    run_stage("--verify", "--to", dest, check=0)
    (dest / "src" / "a" / "small.txt").write_bytes(b"x" * 100)  # same size, other bytes
    proc = run_stage("--verify", "--to", dest, check=4)
    assert "checksum mismatch: src/a/small.txt" in proc.stderr


# -- re-runs ----------------------------------------------------------------------------------
def test_rerun_skips_and_recopies_changed(tmp_path, run_stage, make_tree):
    src = make_tree(tmp_path / "src")
    dest = tmp_path / "dest"
    assert summary(run_stage(src, "--to", dest, "--json", check=0))["files"] == N_TREE

    doc = summary(run_stage(src, "--to", dest, "--json", check=0))
    assert (doc["files"], doc["bytes"], doc["skipped"], doc["skipped_bytes"]) == (
        0,
        0,
        N_TREE,
        TREE_TOTAL,
    )
    assert_clean_meta(dest)

    for f in (dest / "src").rglob("*.bin"):  # as a DEST keeping whole seconds stores them
        st = f.stat()
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns // 10**9 * 10**9))
    doc = summary(run_stage(src, "--to", dest, "--json", check=0))
    assert (doc["files"], doc["skipped"]) == (0, N_TREE)  # not copied again on every run

    touched = src / "a" / "page.bin"  # same bytes, new mtime
    st = touched.stat()
    os.utime(touched, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    doc = summary(run_stage(src, "--to", dest, "--json", check=0))
    assert (doc["files"], doc["bytes"], doc["skipped"]) == (1, 4096, N_TREE - 1)
    assert (dest / "src" / "a" / "page.bin").stat().st_mtime_ns == touched.stat().st_mtime_ns

    rewritten = src / "z" / "last.bin"
    new = random_bytes(777, seed=1234)
    rewritten.write_bytes(new)
    doc = summary(run_stage(src, "--to", dest, "--json", check=0))
    assert (doc["files"], doc["bytes"], doc["skipped"]) == (1, 777, N_TREE - 1)
    assert (dest / "src" / "z" / "last.bin").read_bytes() == new
    assert manifest(dest)["entries"]["src/z/last.bin"]["hash"] == expected_digest(new)
    assert snapshot(dest) == prefixed(snapshot(src), "src")
    assert_clean_meta(dest)

    with open(dest / "src" / "a" / "b" / "odd.bin", "r+b") as f:  # corrupted in DEST, same size
        f.write(b"\0")
    (dest / "src" / "a" / "small.txt").unlink()
    doc = summary(run_stage(src, "--to", dest, "--json", check=0))
    assert (doc["files"], doc["skipped"]) == (2, N_TREE - 2)  # both used to be skipped
    assert snapshot(dest) == prefixed(snapshot(src), "src")
    run_stage("--verify", "--to", dest, check=0)


@pytest.mark.parametrize("suffix", [".tar", ".tar.zst"])
def test_rerun_of_archive_skips(tmp_path, run_stage, make_tree, suffix):
    tree = archive_tree(tmp_path / "tree", make_tree)
    arc = make_archive(tree, tmp_path / f"data{suffix}")
    dest = tmp_path / "dest"
    run_stage(arc, "--to", dest, "-q", check=0)
    doc = summary(run_stage(arc, "--to", dest, "--json", check=0))
    assert (doc["files"], doc["skipped"]) == (0, N_TREE + 2)
    (dest / "a" / "small.txt").unlink()  # a deleted staged file comes back on the next run
    doc = summary(run_stage(arc, "--to", dest, "--json", check=0))
    assert (doc["files"], doc["skipped"]) == (1, N_TREE + 1)
    assert snapshot(dest) == snapshot(tree)
    assert_clean_meta(dest)


# -- verify -----------------------------------------------------------------------------------
def test_verify_clean_flipped_and_missing(tmp_path, run_stage, make_tree):
    src = make_tree(tmp_path / "src")
    dest = tmp_path / "dest"
    run_stage(src, "--to", dest, "-q", check=0)
    proc = run_stage("--verify", "--to", dest, check=0)
    assert proc.stdout.strip() == f"verified {N_TREE} entries: 0 problem(s)"
    assert proc.stderr == ""

    victim = dest / "src" / "a" / "b" / "odd.bin"
    data = bytearray(victim.read_bytes())
    data[40_000] ^= 0xFF
    victim.write_bytes(bytes(data))
    proc = run_stage("--verify", "--to", dest, check=4)
    assert proc.stderr.splitlines() == [
        f"datastore stage: verify: {dest}: checksum mismatch: src/a/b/odd.bin",
        REPAIR,
    ]
    assert proc.stdout.strip() == f"verified {N_TREE} entries: 1 problem(s)"

    (dest / "src" / "a" / "small.txt").unlink()
    proc = run_stage("--verify", "--to", dest, "--json", check=4)
    assert sorted(proc.stderr.splitlines()) == sorted(
        [
            f"datastore stage: verify: {dest}: checksum mismatch: src/a/b/odd.bin",
            f"datastore stage: verify: {dest}: missing: src/a/small.txt",
            REPAIR,
        ]
    )
    doc = summary(proc)
    assert doc["verified"] == N_TREE
    assert sorted(doc["problems"]) == [
        f"{dest}: checksum mismatch: src/a/b/odd.bin",
        f"{dest}: missing: src/a/small.txt",
    ]


def test_verify_names_a_file_it_cannot_reach_or_read_and_checks_the_rest(
    tmp_path, run_stage, monkeypatch
):
    """One entry's ``OSError`` ended the whole verify (``verified 0 entries: 0 problem(s)``,
    exit 1, ``[Errno 20] Not a directory``): a file whose directory in DEST became a file is
    missing, one that fails to read (an I/O error) is unreadable, and every other is checked."""
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    for name in ("a/x", "b", "c"):
        (src / name).write_bytes(name.encode())
    dest = tmp_path / "dest"
    run_stage(src, "--to", dest, "-q", check=0)
    shutil.rmtree(dest / "src" / "a")
    (dest / "src" / "a").write_bytes(b"a file now")
    real = staging.verify.hash_range

    def failing(fd, off, n, algo, *rest):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("/b"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, off, n, algo, *rest)

    monkeypatch.setattr(staging.verify, "hash_range", failing)
    assert staging.verify.verify_dest(str(dest), 2) == (
        3, ["missing: src/a/x", "unreadable: src/b (Input/output error)"]
    )  # fmt: skip


def test_verify_without_manifest(tmp_path, run_stage):
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "f").write_bytes(b"not staged")
    proc = run_stage("--verify", "--to", plain, check=1)
    assert proc.stderr.splitlines() == [
        f"datastore stage: verify: {plain}: no manifest (nothing was staged here with "
        "datastore stage)"
    ]
    assert_clean_stderr(proc)
    assert os.listdir(plain) == ["f"]


@pytest.mark.parametrize("target", ["other/.datastore", "gone"])
def test_verify_refuses_a_link_where_dest_datastore_belongs_in_one_line(tmp_path, capsys, target):
    """A link, live or dangling, where ``DEST/.datastore`` belongs: ``--verify`` said
    ``DEST: [Errno 1] refusing to write through a symlink`` (a dangling one: ``no manifest``);
    it reads through nothing and writes nothing, so it says what it refused to read."""
    from datastore.cli import main

    other, dest = tmp_path / "other" / ".datastore", tmp_path / "dest"
    other.mkdir(parents=True)
    (other / "manifest.json").write_text('{"version": 1, "entries": {}}')
    dest.mkdir()
    (dest / ".datastore").symlink_to(tmp_path / target)
    assert main(["stage", "--verify", "--to", str(dest), "--quiet"]) == Exit.FAILED
    assert capsys.readouterr().err == (
        f"datastore stage: verify: {dest}: refusing to read through a symlink: {dest}/.datastore\n"
    )


def test_stage_then_verify_in_one_run(tmp_path, run_stage, make_tree):
    src = make_tree(tmp_path / "src")
    dest = tmp_path / "dest"
    proc = run_stage(src, "--to", dest, "--verify", check=0)
    assert f"verified {N_TREE} entries: 0 problem(s)" in proc.stdout.splitlines()
    assert proc.stdout.startswith(f"staged {N_TREE} files")


# -- output for people: binary units ----------------------------------------------------------
def test_summary_line_in_binary_units():
    doc = {"files": 37, "bytes": 18 * MIB, "seconds": 0.11, "mib_per_s": 163.6, "skipped": 2,
           "skipped_bytes": 1536, "resumed_bytes": 3 * MIB // 2, "ranks": 2, "nodes": 1,
           "mode": "replicate", "errors": ["e"]}  # fmt: skip
    assert summary_line(doc) == (
        "staged 37 files, 18.0 MiB in 0.11 s (164 MiB/s) on 1 node(s), 2 rank(s); skipped 2 "
        "unchanged (1.5 KiB); resumed 1.5 MiB of partial copies; 1 error(s)"
    )


def test_the_same_error_of_every_node_is_said_once(capsys):
    """Replicate mode: a source file no rank can read failed on each node, and the summary
    printed its line once per node (3 identical lines and '3 error(s)' on 3 nodes)."""
    cfg = StageConfig(dest="/d", sources=("/s",), mode="replicate")
    lay = Layout(rank=0, size=3, node=0, nodes=3, local_rank=0, local_size=1)
    same = ["/s/a: Permission denied"]
    every = [Stats(files=2, errors=list(same)) for _ in range(3)] + [Stats(errors=["/s/b: x"])]
    _Log(cfg, lay).summary(Plan(), every, 1.0, lay, 0)
    out, err = capsys.readouterr()
    assert (
        err == "datastore stage: error: /s/a: Permission denied\ndatastore stage: error: /s/b: x\n"
    )
    assert out.endswith("; 2 error(s)\n")
    _Log(cfg, lay).errors(["/local: not enough space: need 1 B, 0 B available"] * 3)
    assert capsys.readouterr().err.count("not enough space") == 1


def test_stage_summary_in_binary_units(tmp_path, run_stage, make_tree):
    src = make_tree(tmp_path / "src")
    proc = run_stage(src, "--to", tmp_path / "dest", check=0)
    size = f"{TREE_TOTAL / 1024:.1f} KiB"
    assert re.fullmatch(
        rf"staged {N_TREE} files, {re.escape(size)} in \d+\.\d\d s \(\d+ MiB/s\) on 1 node\(s\), "
        r"1 rank\(s\); skipped 0 unchanged \(0 B\)\n",
        proc.stdout,
    ), proc.stdout
    doc = summary(run_stage(src, "--to", tmp_path / "json", "--json", check=0))
    assert "mb_per_s" not in doc and type(doc["mib_per_s"]) is float
    dry = run_stage(src, "--to", tmp_path / "dry", "--dry-run", check=0).stdout.splitlines()[-1]
    assert re.fullmatch(r"estimated time: .* \(probed read \d+ MiB/s, write \d+ MiB/s, .*\)", dry)


def test_a_dry_run_says_what_its_probes_could_not_measure(tmp_path, capsys, monkeypatch):
    """A DEST without room for the 64 MiB write probe ended ``--dry-run`` with ``internal error:
    OSError: [Errno 28] No space left on device``, nothing listed; with nothing to copy, the
    read probe was ``"read_mib_per_s": Infinity`` (not JSON). Both are null now."""
    src = tmp_path / "ds"
    src.mkdir()
    (src / "f").write_bytes(b"x" * 4096)
    dest = tmp_path / "dest"
    cfg = StageConfig(dest=str(dest), sources=(str(src),), dry_run=True, json=True)

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fdatasync", full)
    assert dry_run(cfg) == Exit.OK
    doc = json.loads(capsys.readouterr().out)
    assert (doc["files"], doc["write_mib_per_s"]) == (1, None) and doc["read_mib_per_s"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]  # the probe left nothing
    monkeypatch.undo()
    assert stage(StageConfig(dest=str(dest), sources=(str(src),), quiet=True), world()) == 0
    assert dry_run(cfg) == Exit.OK
    doc = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(c))
    assert (doc["files"], doc["read_mib_per_s"]) == (0, None) and doc["write_mib_per_s"] > 0


def test_a_dry_run_says_what_the_run_would_refuse_for_space(tmp_path, capsys, monkeypatch):
    """40 MiB to stage on an 8 MiB DEST: ``--dry-run`` said ``would stage 41 files, 40.3 MiB``,
    exit 0, and the run then refused it (exit 3). The dry run says so as the run would."""
    src = tmp_path / "ds"
    src.mkdir()
    (src / "f").write_bytes(b"x" * 3 * MIB)
    usage = shutil.disk_usage(tmp_path)._replace(total=8 * MIB, free=2 * MIB)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage)
    cfg = StageConfig(dest=str(tmp_path / "dest"), sources=(str(src),), dry_run=True)
    assert dry_run(cfg) == Exit.NO_SPACE
    out, err = capsys.readouterr()
    assert "would stage 1 files, 3.0 MiB" in out
    want = "not enough space: need 3.0 MiB, 2.0 MiB available"
    assert err == f"datastore stage: error: {cfg.dest}: {want}\n"


@pytest.mark.parametrize("what", ["corrupt", "link", "dangling link"])
def test_a_dry_run_says_what_the_run_would_refuse_in_dest_datastore(tmp_path, capsys, what):
    """A corrupt manifest, or a link where ``DEST/.datastore`` belongs: ``--dry-run`` ended in
    'internal error: ValueError' or 'PermissionError' where the run refuses DEST in one line,
    exit 1 (a dangling link: 'would stage', exit 0). The dry run says what the run would, exit
    1, and writes nothing."""
    src, dest = tmp_path / "ds", tmp_path / "dest"
    src.mkdir()
    (src / "f").write_bytes(b"f")
    (tmp_path / "other" / ".datastore").mkdir(parents=True)
    dest.mkdir()
    if what == "corrupt":
        (dest / ".datastore").mkdir()
        (dest / ".datastore" / "manifest.json").write_text("garbage")
        json_error = "Expecting value: line 1 column 1 (char 0)"
        why = f"{dest}/.datastore/manifest.json: corrupt manifest ({json_error})"
    else:
        target = "other/.datastore" if what == "link" else "gone"
        (dest / ".datastore").symlink_to(tmp_path / target)
        why = f"refusing to write through a symlink: {dest}/.datastore"
    cfg = StageConfig(dest=str(dest), sources=(str(src),), dry_run=True)
    assert dry_run(cfg) == Exit.FAILED
    assert capsys.readouterr().err == (
        f"datastore stage: error: {dest}: cannot prepare destination ({why})\n"
    )
    assert sorted(os.listdir(dest)) == [".datastore"] and not (dest / "ds").exists()


class _TwoNodes:
    """Rank ``rank`` of a 2-rank world, one rank a node; ``theirs``: what the other rank
    gathers to rank 0, ``code``: what rank 0 broadcasts."""

    def __init__(self, rank: int, theirs=None, code=None):
        self.rank, self.theirs, self.code, self.sent = rank, theirs, code, "nothing"

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return 2

    def gather(self, obj, root=0):
        self.sent = obj
        return [obj, self.theirs] if self.rank == 0 else None

    def bcast(self, obj, root=0):
        return obj if self.rank == 0 else self.code


def test_a_dry_run_under_mpi_checks_every_nodes_space(tmp_path, capsys, monkeypatch):
    """Node 1 of 2 without room for its share: ``--dry-run --mode shard`` printed node 0's
    ``would stage``, exit 0, and the run then refused it (exit 3, naming node 1's DEST)."""
    from datastore.cli import main

    src = tmp_path / "ds"
    src.mkdir()
    for name in "ab":  # one file a node
        (src / name).write_bytes(b"x" * 3 * MIB)
    for k in range(2):
        (tmp_path / f"node{k}").mkdir()
    real = shutil.disk_usage

    def usage(path):
        small = real(path)._replace(total=8 * MIB, free=MIB)
        return small if str(path).endswith("node1") else real(path)

    monkeypatch.setattr(shutil, "disk_usage", usage)
    args = ["stage", str(src), "--to", str(tmp_path / "node{node}"), "--mode", "shard"]
    want = f"{tmp_path}/node1: not enough space: need 3.0 MiB, 1.0 MiB available"
    for rank, theirs in ((1, None), (0, (want, Exit.NO_SPACE))):
        comm = _TwoNodes(rank, theirs, code=Exit.NO_SPACE)
        monkeypatch.setattr("staging.cluster.world", lambda comm=comm: comm)
        lay = Layout(rank, 2, rank, 2, 0, 1)
        monkeypatch.setattr("staging.cluster.layout", lambda c, r, lay=lay: (lay, c))
        assert main([*args, "--dry-run"]) == Exit.NO_SPACE
        if rank == 1:  # node 1 checks its share's space, and tells rank 0
            assert comm.sent == (want, Exit.NO_SPACE)
    out, err = capsys.readouterr()
    assert f"into {tmp_path}/node0 (node 0 of 2)" in out
    assert err == f"datastore stage: error: {want}\n"


def test_a_dry_run_under_mpi_says_what_another_node_would_refuse_in_its_dest(
    tmp_path, capsys, monkeypatch
):
    """Node 1's DEST with a corrupt manifest: ``--dry-run`` checked node 1's space only and
    said ``would stage``, exit 0, where the run refuses node 1's DEST, exit 1. Node 1 says
    what its run would refuse, rank 0 prints it, exit 1 on every rank."""
    from datastore.cli import main

    src = tmp_path / "ds"
    src.mkdir()
    (src / "f").write_bytes(b"f")
    (tmp_path / "node1" / ".datastore").mkdir(parents=True)
    (tmp_path / "node1" / ".datastore" / "manifest.json").write_text("garbage")
    args = ["stage", str(src), "--to", str(tmp_path / "node{node}"), "--dry-run"]
    json_error = "Expecting value: line 1 column 1 (char 0)"
    want = (
        f"{tmp_path}/node1: cannot prepare destination "
        f"({tmp_path}/node1/.datastore/manifest.json: corrupt manifest ({json_error}))"
    )
    for rank, theirs in ((1, None), (0, (want, Exit.FAILED))):
        comm = _TwoNodes(rank, theirs, code=Exit.FAILED)
        monkeypatch.setattr("staging.cluster.world", lambda comm=comm: comm)
        lay = Layout(rank, 2, rank, 2, 0, 1)
        monkeypatch.setattr("staging.cluster.layout", lambda c, r, lay=lay: (lay, c))
        assert main(args) == Exit.FAILED
        if rank == 1:
            assert comm.sent == (want, Exit.FAILED)
    out, err = capsys.readouterr()
    assert f"into {tmp_path}/node0 (node 0 of 2)" in out
    assert err == f"datastore stage: error: {want}\n"
    assert not (tmp_path / "node0").exists()


def test_progress_bar_in_binary_units():
    """The bar's columns, rendered for a task that moved 2 MiB in the last second (rich's
    clock given, so nothing depends on time)."""
    from rich.progress import Progress as Bar

    now = [0.0]
    bar = Bar(*bar_columns(), get_time=lambda: now[0], disable=True)
    task = bar.add_task("staging", total=4 * MIB)
    for t, n in ((1.0, MIB // 2), (2.0, 2 * MIB)):
        now[0] = t
        bar.advance(task, n)
    _, done, rate, _ = (str(c.render(bar.tasks[0])) for c in bar.columns)
    assert (done, rate) == ("2.5 MiB / 4.0 MiB", "2.0 MiB/s")


# -- debris -----------------------------------------------------------------------------------
def test_no_temporary_debris(tmp_path, run_stage, make_tree):
    src = make_tree(tmp_path / "src")
    tree = archive_tree(tmp_path / "tree", make_tree)
    arc = make_archive(tree, tmp_path / "data.tar.zst")  # with a hardlink
    dest = tmp_path / "dest"
    for _ in range(2):
        run_stage(src, arc, "--to", dest, "-q", check=0)
        assert_clean_meta(dest)
        assert not (dest / META / "tmp").exists()
        assert not [n for n in meta_listing(dest) if n.startswith("journal-")]
    run_stage("--verify", "--to", dest, check=0)
    assert_clean_meta(dest)


# -- dry run ----------------------------------------------------------------------------------
def test_dry_run_writes_nothing_and_lists_items(tmp_path, run_stage, make_tree):
    src = make_tree(tmp_path / "src")
    dest = tmp_path / "dest"
    before = sorted(os.listdir(tmp_path))
    proc = run_stage(src, "--to", dest, "--dry-run", check=0)
    assert_clean_stderr(proc)
    assert not dest.exists()
    assert sorted(os.listdir(tmp_path)) == before  # the probe left nothing behind
    lines = proc.stdout.splitlines()
    copy_lines = [ln for ln in lines if ln.startswith("copy ")]
    assert len(copy_lines) == N_TREE
    for rel, _, _ in TREE_FILES:
        pat = (
            rf"copy +\d+(\.\d)? (B|KiB|MiB)  {re.escape(f'src/{rel}')}  <-  "
            rf"{re.escape(str(src / rel))}"
        )
        assert sum(bool(re.fullmatch(pat, ln)) for ln in copy_lines) == 1, rel
    assert any(
        ln.startswith(f"would stage {N_TREE} files, ")
        and f"({TREE_TOTAL} bytes) into {dest}; 0 unchanged would be skipped" in ln
        for ln in lines
    ), proc.stdout


def test_dry_run_json(tmp_path, run_stage, make_tree):
    src = make_tree(tmp_path / "src")
    dest = tmp_path / "dest"
    doc = summary(run_stage(src, "--to", dest, "--dry-run", "--json", check=0))
    assert not dest.exists()
    assert (doc["files"], doc["bytes"], doc["skipped"]) == (N_TREE, TREE_TOTAL, 0)
    assert isinstance(doc["estimate_s"], (int, float)) and doc["estimate_s"] >= 0
    assert {i["dest"] for i in doc["items"]} == {f"src/{rel}" for rel, _, _ in TREE_FILES}
    # against a staged DEST: nothing left to do, and the dry run still writes nothing
    run_stage(src, "--to", dest, "-q", check=0)
    before = snapshot(dest), meta_listing(dest)
    doc = summary(run_stage(src, "--to", dest, "--dry-run", "--json", check=0))
    assert (doc["files"], doc["bytes"], doc["skipped"]) == (0, 0, N_TREE)
    assert (snapshot(dest), meta_listing(dest)) == before


# -- bad input --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["SRC"], "the following arguments are required: --to"),
        (["SRC", "--to", "DEST", "--streams", "0"], "argument --streams: must be a whole"),
        (["SRC", "--to", "DEST", "--mode", "bogus"], "argument --mode: invalid choice: 'bogus'"),
        (["SRC", "--to", "DEST", "--checksum", "md5"], "argument --checksum: invalid choice"),
        (["SRC", "--to", "DEST", "--ranks-per-node", "0"], "argument --ranks-per-node: must be"),
        (["--to", "DEST"], "give at least one SRC to stage (or --verify to check DEST)"),
    ],
    ids=["missing-to", "streams-0", "unknown-mode", "unknown-checksum", "rpn-0", "no-src"],
)
def test_usage_errors(tmp_path, run_stage, args, fragment):
    src = tmp_path / "src.bin"
    src.write_bytes(b"data")
    dest = tmp_path / "dest"
    argv = [str(src) if a == "SRC" else str(dest) if a == "DEST" else a for a in args]
    proc = run_stage(*argv, check=2)
    assert_clean_stderr(proc)
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1, proc.stderr  # argparse's usage came above it
    assert proc.stderr.startswith("datastore stage: error: ")
    assert fragment in proc.stderr
    assert not dest.exists()


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--streams", "x"),
        ("--streams", "1.5"),
        ("--streams", "0"),
        ("--ranks-per-node", "x"),
        ("--ranks-per-node", "-2"),
    ],
)
@pytest.mark.parametrize("service", [False, True])
def test_a_bad_count_is_one_line_naming_its_option(tmp_path, capsys, option, value, service):
    """``--streams x`` or ``--ranks-per-node x``: argparse's usage (9 lines) came above
    ``argument --streams: invalid int value: 'x'``; one line, exit 2, as serve's and plan's
    numbers, here or with ``--service``."""
    from datastore.cli import main

    src = tmp_path / "src.bin"
    src.write_bytes(b"data")
    more = ["--service", str(tmp_path / "s.sock")] if service else []
    assert main(["stage", str(src), "--to", str(tmp_path / "dest"), option, value, *more]) == 2
    assert capsys.readouterr() == (
        "",
        f"datastore stage: error: argument {option}: must be a whole number >= 1, got {value!r} "
        "(see datastore stage --help)\n",
    )
    assert not (tmp_path / "dest").exists()


def test_missing_source_others_still_staged(tmp_path, run_stage, make_tree):
    good = make_tree(tmp_path / "good")
    single = tmp_path / "single.bin"
    single.write_bytes(random_bytes(999, seed=5))
    missing = tmp_path / "no-such-dir"
    dest = tmp_path / "dest"
    proc = run_stage(good, missing, single, "--to", dest, check=2)
    assert_clean_stderr(proc)
    assert f"datastore stage: error: {missing}: source not found or unreadable" in proc.stderr
    assert snapshot(dest) == {
        **prefixed(snapshot(good), "good"),
        "single.bin": ("file", single.read_bytes()),
    }
    assert_clean_meta(dest)


def test_two_sources_same_destination(tmp_path, run_stage):
    first = tmp_path / "a" / "data"
    second = tmp_path / "b" / "data"
    first.mkdir(parents=True)
    second.mkdir(parents=True)
    (first / "x.bin").write_bytes(b"from a\n")
    (second / "x.bin").write_bytes(b"from b\n")
    (second / "y.bin").write_bytes(b"only in b\n")
    dest = tmp_path / "dest"
    proc = run_stage(first, second, "--to", dest, check=2)
    assert_clean_stderr(proc)
    assert (
        f"datastore stage: error: {second}: would overwrite 'data/x.bin', already staged "
        f"from {first}"
    ) in proc.stderr.splitlines()
    assert snapshot(dest) == {"data": ("dir",), "data/x.bin": ("file", b"from a\n")}


# -- space ------------------------------------------------------------------------------------
def _mount_tmpfs(where: Path, size: str, inodes: int | None = None) -> None:
    options = f"size={size}" + (f",nr_inodes={inodes}" if inodes else "")
    try:
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except FileNotFoundError as exc:
        pytest.skip(f"cannot mount a tmpfs: {exc}")
    if proc.returncode != 0:
        msg = (proc.stderr + proc.stdout).strip()
        low = msg.lower()
        if any(k in low for k in ("permission denied", "not permitted", "superuser", "only root")):
            pytest.skip(f"cannot mount a tmpfs here: {msg}")
        pytest.fail(f"mount failed (exit {proc.returncode}): {msg}")


def test_not_enough_space(tmp_path, run_stage):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "a.bin").write_bytes(random_bytes(4 << 20, seed=1))
    (src / "b.bin").write_bytes(random_bytes(4 << 20, seed=2))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    _mount_tmpfs(mnt, "4M")
    try:
        dest = mnt / "dest"
        proc = run_stage(src, "--to", dest, check=3)
        assert_clean_stderr(proc)
        m = re.search(
            rf"datastore stage: error: {re.escape(str(dest))}: not enough space: "
            r"need 8\.0 MiB, (\d+\.\d) (KiB|MiB) available",
            proc.stderr,
        )
        assert m, proc.stderr
        avail = float(m.group(1)) * (1024 if m.group(2) == "KiB" else 1024 * 1024)
        assert avail <= 4 << 20
        # The refused run leaves nothing it made: DEST, .datastore, DEST's missing parents
        # (they used to stay behind, an empty DEST with a lock)...
        assert os.listdir(mnt) == []
        run_stage(src, "--to", mnt / "new" / "dest", check=3)
        assert os.listdir(mnt) == []
        # ... an existing DEST is left as it was ...
        dest.mkdir()
        run_stage(src, "--to", dest, check=3)
        assert os.listdir(dest) == []
        # ... and one staged before keeps what it has: files, manifest, lock.
        small = tmp_path / "small"
        small.mkdir()
        (small / "c.bin").write_bytes(b"staged before\n")
        run_stage(small, "--to", dest, check=0)
        before = snapshot(dest), meta_listing(dest), (dest / META / "manifest.json").read_bytes()
        run_stage(src, "--to", dest, check=3)
        after = snapshot(dest), meta_listing(dest), (dest / META / "manifest.json").read_bytes()
        assert after == before
        assert before[0] == {"small": ("dir",), "small/c.bin": ("file", b"staged before\n")}
    finally:
        subprocess.run(["umount", str(mnt)], check=True, timeout=30)


def _small_files_and_a_tmpfs(tmp: Path, name: str, n: int, size: str, inodes: int) -> tuple:
    """``(tmp/name holding files f00.. of a few bytes each, tmp/mnt: a tmpfs of size and
    inodes mounted)``; the caller unmounts it."""
    src = tmp / name
    src.mkdir()
    for k in range(n):
        (src / f"f{k:02d}").write_bytes(b"%d\n" % k)
    mnt = tmp / "mnt"
    mnt.mkdir()
    _mount_tmpfs(mnt, size, inodes=inodes)
    return src, mnt


def test_out_of_inodes_fails_the_run_naming_the_files(tmp_path, run_stage):
    """No inode left on DEST is a full disk too: the files that do not fit are named, those
    placed recorded, nothing left in .datastore (it was an internal error on a temp
    subdirectory, leaving tmp/ and a journal, then one on the manifest)."""
    src, mnt = _small_files_and_a_tmpfs(tmp_path, "mid", 60, "50M", inodes=30)
    try:
        dest = mnt / "dest"
        proc = run_stage(src, "--to", dest, "--json", check=1)
        assert_clean_stderr(proc)
        doc = summary(proc)
        placed = sorted(p.name for p in (dest / "mid").iterdir())
        assert 0 < doc["files"] == len(placed) < 60
        assert sorted(doc["errors"]) == [
            f"{src / name}: No space left on device"
            for name in sorted({f"f{k:02d}" for k in range(60)} - set(placed))
        ]
        assert sorted(manifest(dest)["entries"]) == [f"mid/{name}" for name in placed]
        assert_clean_meta(dest)
    finally:
        subprocess.run(["umount", str(mnt)], check=True, timeout=30)


@pytest.mark.parametrize(
    ("inodes", "code", "says"),
    [
        (3, 3, "cannot prepare destination (No space left on device: no space, or no inode, "),
        (4, 3, "cannot prepare destination (No space left on device: no space, or no inode, "),
        (6, 1, "cannot write its journal: No space left on device"),
    ],
    ids=["no-lock", "no-temp-dir", "no-journal"],
)
def test_too_few_inodes_for_its_own_files_is_one_line(tmp_path, run_stage, inodes, code, says):
    """With no inode for the lock, the temp directory or the journal, the run failed with an
    internal error (temp directory, journal) or left DEST and DEST/.datastore behind (lock)."""
    src, mnt = _small_files_and_a_tmpfs(tmp_path, "tree", 10, "10M", inodes=inodes)
    try:
        dest = mnt / "dest"
        proc = run_stage(src, "--to", dest, check=code)
        assert_clean_stderr(proc)
        assert f"datastore stage: error: {dest}: {says}" in proc.stderr
        if code == 3:  # refused before anything: nothing of what it made is left
            assert os.listdir(mnt) == []
        else:
            assert list((dest / "tree").iterdir()) == []
            assert_clean_meta(dest)
    finally:
        subprocess.run(["umount", str(mnt)], check=True, timeout=30)


def test_a_shard_run_of_a_parent_keeps_what_was_staged_from_inside_it(tmp_path, run_stage):
    """``stage SRC/a --mode shard`` then ``stage SRC --mode shard`` into the same DEST: the
    second run removed DEST/a (its files' sources lie inside SRC, not at DEST/SRC/a where the
    second run places them, so they were taken for files of another node's share)."""
    src = tmp_path / "data"
    (src / "a").mkdir(parents=True)
    (src / "b").mkdir()
    (src / "a" / "x").write_bytes(b"one\n")
    (src / "b" / "y").write_bytes(b"two\n")
    dest = tmp_path / "dest"
    run_stage(src / "a", "--to", dest, "--mode", "shard", check=0)
    run_stage(src, "--to", dest, "--mode", "shard", check=0)
    assert (dest / "a" / "x").read_bytes() == b"one\n"
    assert (dest / "data" / "a" / "x").read_bytes() == b"one\n"
    assert {"a/x", "data/a/x", "data/b/y"} <= set(manifest(dest)["entries"])


# -- corrupt archives -------------------------------------------------------------------------
def _three_member_tar() -> bytes:
    return tar_bytes(
        [
            (file_info("a.bin"), random_bytes(5000, seed=1)),
            (file_info("b.bin"), random_bytes(200_000, seed=2)),
            (file_info("c.bin"), random_bytes(3000, seed=3)),
        ]
    )


def _truncated(kind: str) -> bytes:
    raw = _three_member_tar()
    if kind == ".tar":
        with tarfile.open(fileobj=io.BytesIO(raw)) as tf:
            b = tf.getmember("b.bin")
        return raw[: b.offset_data + b.size // 2]  # cut in the middle of b.bin's data
    comp = gzip.compress(raw) if kind == ".tar.gz" else zstandard.ZstdCompressor().compress(raw)
    return comp[: len(comp) // 2]


CORRUPT = "corrupt or truncated archive"


@pytest.mark.parametrize(
    ("name", "make", "member", "says"),
    [
        ("x.tar.gz", lambda: random_bytes(20_000, seed=66), None, CORRUPT),
        ("x.tar.zst", lambda: random_bytes(20_000, seed=67), None, CORRUPT),
        ("x.tar", lambda: random_bytes(20_000, seed=68), None, CORRUPT),
        ("t.tar", lambda: _truncated(".tar"), "b.bin", CORRUPT),
        ("t.tar.gz", lambda: _truncated(".tar.gz"), None, f"{CORRUPT} (Compressed file ended"),
        ("t.tar.zst", lambda: _truncated(".tar.zst"), None, "truncated archive (the zstd stream"),
    ],
    ids=["random-gz", "random-zst", "random-tar", "truncated-tar", "truncated-gz", "truncated-zst"],
)
def test_corrupt_archive(tmp_path, run_stage, name, make, member, says):
    arc = tmp_path / name
    arc.write_bytes(make())
    good = tmp_path / "good.bin"
    good.write_bytes(b"staged anyway\n")
    dest = tmp_path / "dest"
    proc = run_stage(arc, good, "--to", dest, check=2)
    assert_clean_stderr(proc)
    head = f"datastore stage: error: {arc}: "
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith(head)]
    assert len(lines) == 1, proc.stderr
    assert says in lines[0] and "empty file" not in lines[0]
    if member is not None:
        assert f"member {member!r}" in lines[0]
    assert snapshot(dest) == {"good.bin": ("file", b"staged anyway\n")}
    assert str(arc) not in json.dumps(manifest(dest))
    assert_clean_meta(dest)


def test_a_bad_datastore_streams_is_bad_input(tmp_path, run_stage):
    src = tmp_path / "a.bin"
    src.write_bytes(b"x")
    for value in ("abc", "0"):
        proc = run_stage(src, "--to", tmp_path / "dest", env={"DATASTORE_STREAMS": value}, check=2)
        want = f"DATASTORE_STREAMS must be a whole number >= 1, got {value!r}"
        assert proc.stderr == f"datastore stage: error: {want}\n"


@pytest.mark.parametrize("inner", ["", "inner"])
def test_dest_inside_a_source_is_refused(tmp_path, run_stage, inner):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_bytes(b"a\n")
    other = tmp_path / "other.txt"
    other.write_bytes(b"staged anyway\n")
    dest = src / inner if inner else src
    for _ in range(2):  # it used to copy itself one level deeper every run
        proc = run_stage(src, other, "--to", dest, check=2)
        assert f"datastore stage: error: {src}: DEST {dest} lies inside this source" in proc.stderr
    assert snapshot(dest)["other.txt"] == ("file", b"staged anyway\n")
    assert not (dest / "src").exists()
    assert {p.name for p in src.iterdir()} <= {"a.txt", META, "other.txt", inner}


@pytest.mark.parametrize("target", ["dest", "dest/src", "."])
def test_a_symlink_to_dest_inside_a_source_is_refused(tmp_path, run_stage, target):
    """A link into DEST, or to a directory holding it, is named and skipped: it used to copy
    DEST into itself, one level deeper every run, exit 0."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_bytes(b"a\n")
    dest = tmp_path / "dest"
    run_stage(src, "--to", dest, check=0)
    (src / "link").symlink_to(tmp_path / target)
    for _ in range(3):
        proc = run_stage(src, "--to", dest, check=2)
        assert f"{src / 'link'}: a symlink " in proc.stderr
        assert f"DEST {dest}, skipped" in proc.stderr
        assert snapshot(dest) == {"src": ("dir",), "src/a.txt": ("file", b"a\n")}


@pytest.mark.parametrize("inner", ["", "inner", "a/b/inner"])
def test_a_run_that_refuses_every_source_leaves_nothing_in_it(tmp_path, run_stage, inner):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_bytes(b"a\n")
    dest = src / inner if inner else src
    proc = run_stage(src, "--to", dest, check=2)
    assert f"datastore stage: error: {src}: DEST {dest} lies inside this source" in proc.stderr
    assert sorted(str(p.relative_to(src)) for p in src.rglob("*")) == ["a.txt"]  # no .datastore
    assert_clean_stderr(proc)


@pytest.mark.parametrize(
    "text",
    [
        b"{bad",
        b"[]",
        b'{"entries": 5}',
        b"\xff\xfe",
        b'{"version": 1, "entries": {"x": 5}}',
        b'{"version": 1, "entries": {"x": {"kind": "file"}}}',
        b'{"version": 1, "entries": {}, "archives": {"a.tar": []}}',
    ],
)
def test_a_corrupt_manifest_is_named(tmp_path, run_stage, text):
    src = tmp_path / "a.bin"
    src.write_bytes(b"x")
    dest = tmp_path / "dest"
    run_stage(src, "--to", dest, check=0)
    path = dest / META / "manifest.json"
    path.write_bytes(text)
    proc = run_stage("--verify", "--to", dest, check=1)
    assert f"{path}: corrupt manifest" in proc.stderr
    assert "internal error" not in proc.stderr
    proc = run_stage(src, "--to", dest, check=1)
    assert f"{path}: corrupt manifest" in proc.stderr
    assert "internal error" not in proc.stderr
    assert path.read_bytes() == text  # left as it was found


def test_a_file_name_that_is_not_utf8_is_staged(tmp_path, run_stage):
    src = tmp_path / "src"
    src.mkdir()
    odd = os.fsdecode(b"f\xff.bin")
    (src / odd).write_bytes(b"odd\n")
    (src / "ok.bin").write_bytes(b"ok\n")
    dest = tmp_path / "dest"
    run_stage(src, "--to", dest, check=0)
    assert snapshot(dest) == {
        "src": ("dir",),
        "src/ok.bin": ("file", b"ok\n"),
        f"src/{odd}": ("file", b"odd\n"),
    }
    assert_clean_meta(dest)
    run_stage("--verify", "--to", dest, check=0)


def test_ctrl_c_stops_the_copy_at_once_and_places_nothing_unfinished(tmp_path):
    """Ctrl-C used to wait for every queued copy (two 1 GiB files, one stream: both
    copied and committed, exit 130 after 6 s); the copies now stop at their next piece and
    the partial copy stays for a re-run to resume, as after ``kill -9``."""
    src = tmp_path / "huge"
    src.mkdir()
    for name in ("z1", "z2"):
        slow_file(src / name, 1 << 30)
    dest = tmp_path / "dest"
    cmd = [sys.executable, "-m", "datastore", "stage", src, "--to", dest, "--streams", "1"]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.Popen(
        ctrl_c_heard([*cmd, "--checksum", "blake2b"]), env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not any(
            len(p.read_text().splitlines()) > 1 for p in dest.glob(f"{META}/tmp/*/*.leaves")
        ):
            assert proc.poll() is None, (proc.returncode, proc.stderr.read())
            assert time.monotonic() < deadline, "no leaf copied in 60 s"
            time.sleep(0.01)  # until a first leaf is copied
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        assert proc.wait(60) == 130, proc.stderr.read()
        print(f"stopped {time.monotonic() - sent:.2f} s after SIGINT")
    finally:
        proc.kill()
    assert not (dest / "huge" / "z1").exists() and not (dest / "huge" / "z2").exists()
    assert list(dest.glob(f"{META}/tmp/*/*.part"))  # kept for a re-run to resume


def test_a_tar_compressed_another_way_is_copied_with_a_note_not_unpacked(tmp_path, capsys):
    """``stage t.tar.xz t.tar.bz2`` copied both as plain files without a word, where `tar -x`
    would unpack them; each now gets one note (``--no-unpack`` asked for the copy: none)."""
    made = {}
    for name, mode in (("t.tar.xz", "w:xz"), ("t.tar.bz2", "w:bz2"), ("t.tar.gz", "w:gz")):
        with tarfile.open(tmp_path / name, mode) as tar:
            info = tarfile.TarInfo(f"{name}.txt")
            info.size = 2
            tar.addfile(info, io.BytesIO(b"hi"))
        made[name] = str(tmp_path / name)
    dest = tmp_path / "dest"
    cfg = StageConfig(dest=str(dest), sources=tuple(made.values()))
    assert stage(cfg, world()) == Exit.OK
    err = capsys.readouterr().err
    says = "copied as a file, not unpacked (only .tar, .tar.gz/.tgz, .tar.zst/.tzst are)"
    assert err == "".join(
        f"datastore stage: note: {made[n]}: {says}\n" for n in ("t.tar.xz", "t.tar.bz2")
    )
    assert sorted(os.listdir(dest)) == [".datastore", "t.tar.bz2", "t.tar.gz.txt", "t.tar.xz"]
    cfg = StageConfig(dest=str(tmp_path / "kept"), sources=(made["t.tar.xz"],), unpack=False)
    assert stage(cfg, world()) == Exit.OK
    assert capsys.readouterr().err == ""
