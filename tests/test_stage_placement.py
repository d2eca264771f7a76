"""Placement across sources and runs: no write through a staged symlink, no file/dir clash."""

from __future__ import annotations

import json
import os
import stat

from helpers import dir_info, file_info, link_info, run_stage, tar_bytes, write_archive


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


def test_a_file_that_cannot_be_placed_is_not_counted(tmp_path):
    """A directory in DEST where a file goes: that file is named and not counted (the summary
    used to count it as staged)."""
    src = tmp_path / "mid"
    src.mkdir()
    for name in "abc":
        (src / name).write_bytes(name.encode() * 10)
    (tmp_path / "dest" / "mid" / "a").mkdir(parents=True)
    proc = run_stage(src, "--to", tmp_path / "dest", "--json", check=1)
    doc = json.loads(proc.stdout)
    assert (doc["files"], doc["bytes"]) == (2, 20)
    assert len(doc["errors"]) == 1 and "cannot place at mid/a" in doc["errors"][0]
