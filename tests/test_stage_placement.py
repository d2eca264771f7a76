"""Placement across sources and runs: no write through a staged symlink, no file/dir clash."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
from helpers import dir_info, file_info, link_info, run_stage, tar_bytes, write_archive

from staging.cluster import world
from staging.config import StageConfig
from staging.dryrun import dry_run
from staging.exitcodes import Exit
from staging.stage import stage


def test_symlinks_from_other_archives_cannot_redirect_a_write(tmp_path):
    """A holds ``b -> .``, B holds ``l -> b/..``: each is safe alone, together ``l`` is DEST/..;
    C's ``l/evil`` must not land outside DEST, in the same run or a later one."""
    a = write_archive(tmp_path / "a.tar", tar_bytes([(link_info("b", "."), None)]))
    b = write_archive(tmp_path / "b.tar", tar_bytes([(link_info("l", "b/.."), None)]))
    c = write_archive(tmp_path / "c.tar", tar_bytes([(file_info("l/evil"), b"pwned")]))
    dest = tmp_path / "box" / "dest"
    same_run = run_stage(a, b, c, "--to", dest, check=2)  # the plan sees l as link and as dir
    assert "needs 'l' as a directory" in same_run.stderr
    assert not (tmp_path / "box" / "evil").exists()
    run_stage(a, b, "--to", dest, check=0)
    later = run_stage(c, "--to", dest, check=1)  # only the placement check can see it now
    assert "refusing to write through a symlink" in later.stderr
    assert not (tmp_path / "box" / "evil").exists()
    assert not (dest / "l" / "evil").exists()


def test_a_refused_placement_leaves_nothing_the_run_made(tmp_path):
    """The directories made before the refusal, and the .datastore it made, go again: DEST is
    as it was (they used to stay behind)."""
    (tmp_path / "a" / "x" / "y").mkdir(parents=True)
    (tmp_path / "a" / "x" / "y" / "f").write_bytes(b"f")
    (tmp_path / "b" / "sub").mkdir(parents=True)
    (tmp_path / "out").mkdir()
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "b").symlink_to(tmp_path / "out")
    proc = run_stage(tmp_path / "a", tmp_path / "b", "--to", dest, check=1)
    assert f"refusing to write through a symlink: {dest / 'b'}" in proc.stderr
    assert os.listdir(dest) == ["b"]
    assert os.listdir(tmp_path / "out") == []


def test_directory_of_one_source_is_a_file_in_another(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.bin").write_bytes(b"x" * 10)
    arch = write_archive(tmp_path / "f.tar", tar_bytes([(file_info("data"), b"a file")]))
    proc = run_stage(tmp_path / "data", arch, "--to", tmp_path / "dest", check=2)
    assert "would replace directory 'data'" in proc.stderr
    assert (tmp_path / "dest" / "data" / "x.bin").read_bytes() == b"x" * 10
    proc = run_stage(arch, tmp_path / "data", "--to", tmp_path / "dest2", check=2)
    assert "needs 'data' as a directory" in proc.stderr
    assert (tmp_path / "dest2" / "data").read_bytes() == b"a file"


def test_directory_member_clash_with_a_file_source(tmp_path):
    (tmp_path / "d").write_bytes(b"plain file")
    arch = write_archive(tmp_path / "t.tar", tar_bytes([(dir_info("d"), None)]))
    proc = run_stage(tmp_path / "d", arch, "--to", tmp_path / "dest", check=2)
    assert "stages it as a file" in proc.stderr


def test_read_only_mode_is_kept(tmp_path):
    src = tmp_path / "ro.bin"
    src.write_bytes(b"read only")
    src.chmod(0o444)
    run_stage(src, "--to", tmp_path / "dest", check=0)
    assert stat.S_IMODE(os.stat(tmp_path / "dest" / "ro.bin").st_mode) == 0o444
    run_stage("--verify", "--to", tmp_path / "dest", check=0)


def test_a_rerun_gives_a_file_its_sources_new_mode_without_copying_it(tmp_path):
    """A source ``chmod`` since the last run (a script made executable, a file made read-only)
    was not applied by a re-run: the file was up to date, its mode not compared (``rsync -a``
    sets it). It is set now, the file left in place; the setuid bit stays dropped."""
    src = tmp_path / "src" / "ds"
    src.mkdir(parents=True)
    for name in ("run.sh", "ro.bin", "same.bin"):
        (src / name).write_bytes(name.encode())
        (src / name).chmod(0o644)
    dest = tmp_path / "dest"
    assert _stage_here(dest, src) == Exit.OK
    inodes = {n: os.stat(dest / "ds" / n).st_ino for n in ("run.sh", "ro.bin", "same.bin")}
    (src / "run.sh").chmod(0o4755)
    (src / "ro.bin").chmod(0o444)
    assert _stage_here(dest, src) == Exit.OK
    modes = {n: stat.S_IMODE(os.stat(dest / "ds" / n).st_mode) for n in inodes}
    assert modes == {"run.sh": 0o755, "ro.bin": 0o444, "same.bin": 0o644}
    assert {n: os.stat(dest / "ds" / n).st_ino for n in inodes} == inodes  # not copied again
    assert (dest / "ds" / "run.sh").read_bytes() == b"run.sh"


def test_a_file_that_cannot_be_placed_is_not_counted(tmp_path):
    """A directory in DEST where a file goes: that file is named and not counted (the summary
    used to count it as staged)."""
    src = tmp_path / "mid"
    src.mkdir()
    for name in "abc":
        (src / name).write_bytes(name.encode() * 10)
    (tmp_path / "dest" / "mid" / "a").mkdir(parents=True)
    (tmp_path / "dest" / "mid" / "a" / "mine").write_bytes(b"the user's")
    proc = run_stage(src, "--to", tmp_path / "dest", "--json", check=1)
    doc = json.loads(proc.stdout)
    assert (doc["files"], doc["bytes"]) == (2, 20)
    assert len(doc["errors"]) == 1 and "cannot place at mid/a" in doc["errors"][0]


def _stage_here(dest: Path, *sources: Path | str, mode: str = "replicate") -> int:
    cfg = StageConfig(dest=str(dest), sources=tuple(map(str, sources)), quiet=True, mode=mode)
    return stage(cfg, world())


def test_a_rerun_removes_what_the_source_no_longer_has(tmp_path):
    """Replicate mode: files removed from the source stayed in DEST and its manifest after a
    re-run (4 files kept where the source had 1; ``--verify``: 0 problems), with the
    directories that held them; and a drop made after the directories' times were set left
    DEST/ds with the time of the re-run, not the source's."""
    src = tmp_path / "src" / "ds"
    (src / "sub" / "deeper").mkdir(parents=True)
    (src / "keep").mkdir()
    for name in ("a.bin", "b.bin", "sub/deeper/c.bin", "keep/d.bin"):
        (src / name).write_bytes(name.encode())
    dest = tmp_path / "dest"
    assert _stage_here(dest, src) == Exit.OK
    (dest / "ds" / "keep" / "mine.txt").write_text("the user's")
    os.remove(src / "b.bin")
    for name in ("sub/deeper/c.bin", "keep/d.bin"):
        os.remove(src / name)
    os.rmdir(src / "sub" / "deeper")
    os.rmdir(src / "sub")
    os.utime(src, ns=(1_600_000_000_000_000_000,) * 2)
    assert _stage_here(dest, src) == Exit.OK
    staged = sorted(
        str(p.relative_to(dest)) for p in dest.rglob("*") if ".datastore" not in p.parts
    )
    assert staged == ["ds", "ds/a.bin", "ds/keep", "ds/keep/mine.txt"]
    entries = json.loads((dest / ".datastore" / "manifest.json").read_text())["entries"]
    assert sorted(entries) == ["ds/a.bin"]
    assert os.stat(dest / "ds").st_mtime_ns == 1_600_000_000_000_000_000


@pytest.mark.parametrize("mode", ["replicate", "shard"])
def test_a_rerun_with_a_source_error_removes_nothing(tmp_path, mode):
    """A file the walk could not reach is not a file gone (``rsync --delete`` deletes nothing
    after an I/O error either): a re-run with a source missing keeps what was staged (in
    shard mode it went: only a file the plan gives another node may go then)."""
    src = tmp_path / "src" / "ds"
    src.mkdir(parents=True)
    (src / "a.bin").write_bytes(b"a")
    (src / "b.bin").write_bytes(b"b")
    dest = tmp_path / "dest"
    assert _stage_here(dest, src, mode=mode) == Exit.OK
    os.remove(src / "b.bin")
    assert _stage_here(dest, src, tmp_path / "missing", mode=mode) == Exit.BAD_INPUT
    assert (dest / "ds" / "b.bin").read_bytes() == b"b"
    assert _stage_here(dest, src, mode=mode) == Exit.OK  # the source whole again: it goes
    assert not (dest / "ds" / "b.bin").exists()


def test_a_directory_lands_under_its_name_however_it_is_written(tmp_path):
    """``SRC``, ``SRC/`` and ``SRC/.`` all land as DEST/NAME (``cp -r SRC/. DEST`` would copy
    the contents into DEST itself: documented in docs/staging.md)."""
    src = tmp_path / "ds"
    (src / "x").mkdir(parents=True)
    (src / "x" / "b").write_bytes(b"b")
    for k, spelled in enumerate((str(src), f"{src}/", f"{src}/.")):
        dest = tmp_path / f"dest{k}"
        assert _stage_here(dest, Path(spelled)) == Exit.OK
        assert sorted(
            str(p.relative_to(dest)) for p in dest.rglob("*") if ".datastore" not in p.parts
        ) == ["ds", "ds/x", "ds/x/b"]


def test_a_rerun_of_an_archive_removes_the_members_it_no_longer_has(tmp_path):
    """A member gone from a re-made archive stayed in DEST (``tar -xf`` leaves it too; a
    stager that keeps DEST to its sources does not)."""
    dest = tmp_path / "dest"
    arc = tmp_path / "x.tar"
    arc.write_bytes(tar_bytes([(file_info("a"), b"a1"), (file_info("b"), b"b1")]))
    assert _stage_here(dest, arc) == Exit.OK
    arc.write_bytes(tar_bytes([(file_info("a"), b"a22")]))
    assert _stage_here(dest, arc) == Exit.OK
    assert sorted(p.name for p in dest.iterdir()) == [".datastore", "a"]
    assert (dest / "a").read_bytes() == b"a22"


def test_a_dry_run_names_what_a_rerun_would_remove(tmp_path, capsys):
    """A re-run removes what the source no longer has: ``--dry-run`` says so (it listed only
    what would be copied)."""
    src = tmp_path / "src" / "ds"
    src.mkdir(parents=True)
    for name in ("a", "b"):
        (src / name).write_bytes(name.encode())
    dest = tmp_path / "dest"
    assert _stage_here(dest, src) == Exit.OK
    os.remove(src / "b")
    cfg = StageConfig(dest=str(dest), sources=(str(src),), json=True)
    assert dry_run(cfg) == Exit.OK
    doc = json.loads(capsys.readouterr().out)
    assert (doc["files"], doc["skipped"], doc["removed"]) == (0, 1, ["ds/b"])
    assert (dest / "ds" / "b").exists()  # a dry run removes nothing


def test_a_rerun_follows_a_file_become_a_directory_and_back(tmp_path):
    """A source file replaced by a directory of its name refused the whole re-run (exit 1,
    ``File exists``, nothing staged); the reverse left the old directory (``cannot place at
    ds/a: Is a directory``). The old file, or directory, is removed first now."""
    src = tmp_path / "src" / "ds"
    src.mkdir(parents=True)
    (src / "a").write_bytes(b"file")
    dest = tmp_path / "dest"
    assert _stage_here(dest, src) == Exit.OK
    os.remove(src / "a")
    (src / "a").mkdir()
    (src / "a" / "x").write_bytes(b"x")
    assert _stage_here(dest, src) == Exit.OK
    assert (dest / "ds" / "a" / "x").read_bytes() == b"x"
    shutil.rmtree(src / "a")
    (src / "a").write_bytes(b"file again")
    assert _stage_here(dest, src) == Exit.OK
    assert (dest / "ds" / "a").read_bytes() == b"file again"
    entries = json.loads((dest / ".datastore" / "manifest.json").read_text())["entries"]
    assert sorted(entries) == ["ds/a"]


def test_a_new_version_staged_from_another_path_replaces_the_old_one(tmp_path):
    """``stage /v1/ds`` then ``stage /v2/ds`` into one DEST: DEST/ds kept v1's files that v2
    has not (a 3-sample dataset where v2 has 2, one sample from v1; ``--verify``: 0 problems)."""
    for version, names in (("v1", ("f1", "f2", "f3")), ("v2", ("f1", "f2"))):
        (tmp_path / version / "ds").mkdir(parents=True)
        for name in names:
            (tmp_path / version / "ds" / name).write_bytes(f"{version}-{name}".encode())
    dest = tmp_path / "dest"
    assert _stage_here(dest, tmp_path / "v1" / "ds") == Exit.OK
    assert _stage_here(dest, tmp_path / "v2" / "ds") == Exit.OK
    staged = {p.name: p.read_bytes() for p in (dest / "ds").iterdir()}
    assert staged == {"f1": b"v2-f1", "f2": b"v2-f2"}


def test_a_rerun_puts_a_file_where_an_empty_directory_was(tmp_path):
    """An empty directory of the source (or one holding only empty directories) become a file
    failed every re-run (exit 1, ``cannot place at ds/b: Is a directory``): the manifest records
    no directory, so nothing removed it. A directory holding a file of the user's stays."""
    src = tmp_path / "src" / "ds"
    (src / "b" / "c").mkdir(parents=True)
    (src / "e").mkdir()
    dest = tmp_path / "dest"
    assert _stage_here(dest, src) == Exit.OK
    shutil.rmtree(src / "b")
    (src / "b").write_bytes(b"now a file")
    (src / "e").rmdir()
    (src / "e").write_bytes(b"e")
    (dest / "ds" / "e" / "mine").write_bytes(b"the user's")
    assert _stage_here(dest, src) == Exit.FAILED
    assert (dest / "ds" / "b").read_bytes() == b"now a file"
    assert (dest / "ds" / "e" / "mine").read_bytes() == b"the user's"
    entries = json.loads((dest / ".datastore" / "manifest.json").read_text())["entries"]
    assert sorted(entries) == ["ds/b"]


def test_a_source_that_would_land_on_itself_is_refused(tmp_path):
    """``stage /d/ds --to /d`` replaced every file of the source by a copy of itself (exit 0;
    a hardlink to it cut off, a ``.datastore`` left in /d); ``cp -r`` says they are the same
    file. A file source and an archive copied whole are refused the same way."""
    src = tmp_path / "ds"
    src.mkdir()
    (src / "f").write_bytes(b"data")
    os.link(src / "f", tmp_path / "hard")
    archive = write_archive(tmp_path / "a.tar", tar_bytes([(file_info("m"), b"m")]))
    for source, dest in [(src, tmp_path), (src / "f", src), (archive, tmp_path)]:
        cfg = StageConfig(dest=str(dest), sources=(str(source),), quiet=True, unpack=False)
        assert stage(cfg, world()) == Exit.BAD_INPUT
    assert os.stat(src / "f").st_nlink == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.tar", "ds", "hard"]
    assert sorted(p.name for p in src.iterdir()) == ["f"]


def test_a_source_named_twice_is_staged_once(tmp_path):
    """``stage ds ds/`` (or an archive named twice) planned every file twice: the second copy
    found its temp file taken by the first, ``cannot place at ds/f: No such file or
    directory`` for each file, exit 1. ``cp -r`` copies it once."""
    src = tmp_path / "ds"
    src.mkdir()
    (src / "f").write_bytes(b"data")
    archive = write_archive(tmp_path / "a.tar", tar_bytes([(file_info("m"), b"m")]))
    dest = tmp_path / "dest"
    assert _stage_here(dest, src, f"{src}/", archive, archive) == Exit.OK
    entries = json.loads((dest / ".datastore" / "manifest.json").read_text())["entries"]
    assert sorted(entries) == ["ds/f", "m"]
    assert (dest / "ds" / "f").read_bytes() == b"data" and (dest / "m").read_bytes() == b"m"
