"""Hostile archives: every one is refused whole (exit 2), nothing of it is written anywhere,
and the other sources of the same run are staged anyway.

The archives are built by hand with ``tarfile.TarInfo``; each starts with benign members so
that "refused whole" is tested, not just "the bad member is skipped".
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import pytest
from helpers import (
    META,
    dir_info,
    file_info,
    link_info,
    random_bytes,
    snapshot,
    special_info,
    tar_bytes,
    write_archive,
)

from staging.archive import ArchiveError, Member, check_members, list_members, normalize_name

KINDS = (".tar", ".tar.gz", ".tar.zst")

BENIGN = [
    (dir_info("ok/"), None),
    (file_info("ok/one.txt"), b"benign one\n"),
    (file_info("ok/two.bin"), random_bytes(3000, seed=5)),
    (link_info("ok/l", "one.txt"), None),
]


# id -> (bad members after BENIGN, offending member name, reason fragment, paths (relative to
# the test's tmp dir, or absolute) that must not exist afterwards). "{T}" is the tmp dir.
CASES: dict[str, tuple[list, str, str, list[str]]] = {
    "absolute": (
        [(file_info("{T}/evil-abs"), b"evil")],
        "{T}/evil-abs",
        "absolute path",
        ["evil-abs"],
    ),
    "dotdot": (
        [(file_info("../evil"), b"evil")],
        "../evil",
        "'..' path component",
        ["box/evil", "evil"],
    ),
    "dotdot-inner": (
        [(file_info("a/../../evil"), b"evil")],
        "a/../../evil",
        "'..' path component",
        ["box/evil", "evil"],
    ),
    "symlink-out": (
        [(link_info("link", "../../outside"), None)],
        "link",
        "symlink '../../outside' points outside DEST",
        ["outside"],
    ),
    "symlink-abs": (
        [(link_info("link", "/etc"), None)],
        "link",
        "symlink to absolute path '/etc'",
        [],
    ),
    "symlink-chain": (
        [(link_info("l", "b/.."), None), (link_info("b", "."), None)],
        "l",
        "symlink 'b/..' points outside DEST",
        [],
    ),
    "through-symlink": (
        [
            (dir_info("sub/"), None),
            (link_info("link", "sub"), None),
            (file_info("link/file"), b"through"),
        ],
        "link/file",
        "path runs through symlink member 'link'",
        [],
    ),
    "hardlink-abs": (
        [(link_info("hl", "/etc/passwd", hard=True), None)],
        "hl",
        "hardlink to '/etc/passwd', not an earlier file of this archive",
        [],
    ),
    "hardlink-dotdot": (
        [(link_info("hl", "../x", hard=True), None)],
        "hl",
        "hardlink to '../x', not an earlier file of this archive",
        ["box/x", "x"],
    ),
    "chardev": (
        [(special_info("dev/null2", tarfile.CHRTYPE), None)],
        "dev/null2",
        "device or FIFO node",
        [],
    ),
    "blockdev": ([(special_info("blk", tarfile.BLKTYPE), None)], "blk", "device or FIFO node", []),
    "fifo": ([(special_info("fifo", tarfile.FIFOTYPE), None)], "fifo", "device or FIFO node", []),
    "file-over-dir": (
        [(dir_info("d/"), None), (file_info("d"), b"file d")],
        "d",
        "would overwrite a directory of another member",
        [],
    ),
    "file-then-child": (
        [(file_info("a"), b"file a"), (file_info("a/b"), b"file a/b")],
        "a",
        "would overwrite a directory of another member",
        [],
    ),
    "reserved": (
        [(file_info(".datastore/manifest.json"), b"{}")],
        ".datastore/manifest.json",
        "writes into the reserved .datastore/ directory",
        [],
    ),
}


def _subst(text: str, tmp: Path) -> str:
    return text.replace("{T}", str(tmp))


def _build(tmp: Path, case: str, suffix: str) -> Path:
    bad, _, _, _ = CASES[case]
    members = []
    for info, data in BENIGN + bad:
        info = _copy_info(info)
        info.name = _subst(info.name, tmp)
        members.append((info, data))
    return write_archive(tmp / f"bad{suffix}", tar_bytes(members))


def _copy_info(info: tarfile.TarInfo) -> tarfile.TarInfo:
    new = tarfile.TarInfo(info.name)
    for attr in ("type", "mode", "mtime", "linkname", "devmajor", "devminor", "size"):
        setattr(new, attr, getattr(info, attr))
    return new


@pytest.mark.parametrize("suffix", KINDS)
@pytest.mark.parametrize("case", list(CASES))
def test_hostile_archive_refused_whole(tmp_path, run_stage, make_tree, case, suffix):
    _, member, reason, must_not_exist = CASES[case]
    member = _subst(member, tmp_path)
    arc = _build(tmp_path, case, suffix)
    good = make_tree(tmp_path / "good_dir", seed=3)
    box = tmp_path / "box"  # DEST two levels down: "../.." from DEST is still tmp_path
    box.mkdir()
    dest = box / "dest"
    before = sorted(os.listdir(tmp_path))

    proc = run_stage(arc, good, "--to", dest, check=2)

    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr
    line = f"datastore stage: error: {arc}: member {member!r}: "
    hits = [ln for ln in proc.stderr.splitlines() if ln.startswith(line)]
    assert len(hits) == 1, proc.stderr
    assert reason in hits[0], hits[0]
    # nothing of the archive in DEST, the other source staged byte for byte
    assert sorted(os.listdir(dest)) == sorted([META, "good_dir"])
    assert snapshot(dest) == {
        "good_dir": ("dir",),
        **{f"good_dir/{k}": v for k, v in snapshot(good).items()},
    }
    assert set(os.listdir(dest / META)) == {"manifest.json", "lock"}
    doc = json.loads((dest / META / "manifest.json").read_text())
    assert doc["archives"] == {}
    assert all(e["source"].startswith(f"{good}/") for e in doc["entries"].values())
    # nothing outside DEST
    assert sorted(os.listdir(tmp_path)) == before
    assert os.listdir(box) == ["dest"]
    for rel in must_not_exist:
        assert not os.path.lexists(tmp_path / rel), rel


def test_hostile_archive_alone_writes_nothing(tmp_path, run_stage):
    """Without other sources, a refused archive leaves nothing: not even the DEST it made (an
    existing DEST is left as it was)."""
    arc = _build(tmp_path, "through-symlink", ".tar")
    dest = tmp_path / "dest"
    proc = run_stage(arc, "--to", dest, check=2)
    assert f"{arc}: member 'link/file': path runs through symlink member 'link'" in proc.stderr
    assert not dest.exists()
    dest.mkdir()
    run_stage(arc, "--to", dest, check=2)
    assert os.listdir(dest) == []


# -- a corrupt header past the first --------------------------------------------------------
def _spoilt(how: str) -> bytes:
    """A tar of BENIGN with the header of its third member (or its end block) spoilt."""
    raw = tar_bytes(BENIGN)
    with tarfile.open(fileobj=io.BytesIO(raw)) as tf:
        third, last = tf.getmembers()[2], tf.getmembers()[-1]
    at, end = third.offset, last.offset + 512  # (the last member is a link: no data)
    return {
        "checksum": raw[:at] + bytes([raw[at] ^ 0x20]) + raw[at + 1 :],
        "cut-header": raw[: at + 100],
        "cut-zeros": raw[: end + 100],
        "no-end-block": raw[:end],
    }[how]


@pytest.mark.parametrize("suffix", KINDS)
@pytest.mark.parametrize("how", ["checksum", "cut-header", "cut-zeros", "no-end-block"])
def test_a_bad_header_past_the_first_refuses_the_archive(tmp_path, suffix, how):
    """tarfile took a bad header anywhere but first for the end of the archive: the members
    after it were lost without a word, the archive staged with exit 0 (GNU tar exits 2)."""
    arc = write_archive(tmp_path / f"x{suffix}", _spoilt(how))
    kind = {".tar": "tar", ".tar.gz": "gz", ".tar.zst": "zst"}[suffix]
    if how in ("cut-zeros", "no-end-block"):  # zeros cut short, or none, still end it
        got = list_members(str(arc), kind, arc.stat().st_size)
        assert [m.name for m in got] == ["ok", "ok/one.txt", "ok/two.bin", "ok/l"]
        return
    with pytest.raises(ArchiveError) as info:
        list_members(str(arc), kind, arc.stat().st_size)
    reason = "bad checksum" if how == "checksum" else "truncated header"
    assert info.value.reason == f"corrupt or truncated archive ({reason})"


# -- modification times of pax archives ----------------------------------------------------
@pytest.mark.parametrize("suffix", KINDS)
def test_a_pax_mtime_is_kept_to_the_nanosecond(tmp_path, suffix):
    """GNU tar's posix format keeps ns in its pax headers, and ``tar -xf`` restores them;
    staging cut them to the second (7 of 7 mtimes of a ``tar --format=posix`` differed)."""
    from datastore.cli import main

    members = [(dir_info("d/"), None), (file_info("d/f"), b"x"), (file_info("g"), b"y")]
    for (info, _), when in zip(
        members, ["1600000000.123456789", "-1.5", "1600000002.5"], strict=True
    ):
        info.pax_headers = {"mtime": when}
    raw = tar_bytes(members, fmt=tarfile.PAX_FORMAT)
    arc = write_archive(tmp_path / f"x{suffix}", raw)
    kind = {".tar": "tar", ".tar.gz": "gz", ".tar.zst": "zst"}[suffix]
    got = list_members(str(arc), kind, arc.stat().st_size)
    assert [(m.mtime, m.mtime_ns) for m in got] == [
        (1600000000, 1600000000123456789),
        (-1, -1500000000),
        (1600000002, 1600000002500000000),
    ]
    dest = tmp_path / "dest"
    assert main(["stage", str(arc), "--to", str(dest), "--quiet"]) == 0
    assert [os.stat(dest / n).st_mtime_ns for n in ("d", "d/f", "g")] == [
        1600000000123456789,
        -1500000000,
        1600000002500000000,
    ]


# -- check_members, the pure function ---------------------------------------------------------
def M(raw: str, kind: str = "file", link: str = "") -> Member:
    return Member(name=normalize_name(raw), kind=kind, link=link)


OK_PREFIX = [M("ok", "dir"), M("ok/one.txt"), M("ok/l", "symlink", "one.txt")]

REJECT = {
    "absolute": ([M("/tmp/evil")], "/tmp/evil", "absolute path"),
    "dotdot": ([M("../evil")], "../evil", "'..' path component"),
    "dotdot-inner": ([M("a/../../evil")], "a/../../evil", "'..' path component"),
    "dotdot-trailing": ([M("a/..", "dir")], "a/..", "'..' path component"),
    "symlink-out": ([M("link", "symlink", "../../outside")], "link", "points outside DEST"),
    "symlink-out-deep": (
        [M("a/b/link", "symlink", "../../../x")],
        "a/b/link",
        "points outside DEST",
    ),
    "symlink-abs": ([M("link", "symlink", "/etc")], "link", "symlink to absolute path '/etc'"),
    "symlink-via-earlier": (
        [M("up", "symlink", "."), M("l", "symlink", "up/..")],
        "l",
        "points outside DEST",
    ),
    "symlink-via-later": (
        [M("l", "symlink", "b/.."), M("b", "symlink", ".")],
        "l",
        "points outside DEST",
    ),
    "through-symlink": (
        [M("sub", "dir"), M("link", "symlink", "sub"), M("link/file")],
        "link/file",
        "path runs through symlink member 'link'",
    ),
    "through-symlink-dir": (
        [M("link", "symlink", "sub"), M("link/d", "dir")],
        "link/d",
        "path runs through symlink member 'link'",
    ),
    "hardlink-abs": ([M("hl", "hardlink", "/etc/passwd")], "hl", "hardlink to '/etc/passwd'"),
    "hardlink-dotdot": ([M("hl", "hardlink", "../x")], "hl", "hardlink to '../x'"),
    "hardlink-later": ([M("hl", "hardlink", "t"), M("t")], "hl", "hardlink to 't'"),
    "hardlink-to-dir": ([M("d", "dir"), M("hl", "hardlink", "d")], "hl", "hardlink to 'd'"),
    "hardlink-to-symlink": (
        [M("s", "symlink", "ok/one.txt"), M("hl", "hardlink", "s")],
        "hl",
        "hardlink to 's'",
    ),
    "special": ([M("dev/null2", "special")], "dev/null2", "device or FIFO node"),
    "file-over-dir": ([M("d", "dir"), M("d")], "d", "would overwrite a directory"),
    "file-then-child": ([M("a"), M("a/b")], "a", "would overwrite a directory"),
    "symlink-over-dir": ([M("d/f"), M("d", "symlink", "ok")], "d", "would overwrite a directory"),
    "reserved": (
        [M(".datastore/manifest.json")],
        ".datastore/manifest.json",
        "reserved .datastore/",
    ),
    "reserved-dot-slash": ([M("./.datastore/lock")], ".datastore/lock", "reserved .datastore/"),
}


@pytest.mark.parametrize("case", list(REJECT))
def test_check_members_rejects(case):
    bad, member, reason = REJECT[case]
    with pytest.raises(ArchiveError) as info:
        check_members("/data/x.tar", OK_PREFIX + bad)
    exc = info.value
    assert (exc.archive, exc.member) == ("/data/x.tar", member)
    assert reason in exc.reason
    assert str(exc) == f"/data/x.tar: member {member!r}: {exc.reason}"


ACCEPT = {
    "dot-slash": [M("./a/b")],
    "nested-dirs": [M("a", "dir"), M("a/b", "dir"), M("a/b/c"), M("a/f")],
    "implicit-parents": [M("x/y/z"), M("x/w")],
    "symlink-inside": [M("b"), M("a", "dir"), M("a/l", "symlink", "../b")],
    "symlink-to-dest-root": [M("a", "dir"), M("a/l", "symlink", "..")],
    "symlink-dangling-inside": [M("l", "symlink", "not/yet/there")],
    "symlink-chain-inside": [M("d", "dir"), M("s1", "symlink", "d"), M("s2", "symlink", "s1/f")],
    "symlink-to-dir-then-real-dir": [M("real", "dir"), M("s", "symlink", "real"), M("real/f")],
    "hardlink-earlier": [M("t"), M("hl", "hardlink", "t")],
    "hardlink-dot-slash": [M("d/t"), M("hl", "hardlink", "./d/t")],
    "hardlink-chain": [M("t"), M("h1", "hardlink", "t"), M("h2", "hardlink", "h1")],
    "duplicate-files": [M("f"), M("g"), M("f")],
    "duplicate-dirs": [M("d", "dir"), M("d/f"), M("d", "dir")],
    "dots-in-names": [M("..hidden"), M("a/...x"), M("a.."), M(".datastore-not")],
    "empty": [],
}


@pytest.mark.parametrize("case", list(ACCEPT))
def test_check_members_accepts(case):
    check_members("/data/x.tar", OK_PREFIX + ACCEPT[case])


def test_normalize_name():
    assert normalize_name("./a//./b/") == "a/b"
    assert normalize_name("/abs//x") == "/abs/x"
    assert normalize_name("a/../b") == "a/../b"
    assert normalize_name("./") == ""
