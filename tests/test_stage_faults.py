"""Faults the copy engine must turn into errors, not hangs: a ``syncfs`` that fails leaves the
batch's files unplaced, names them, removes their temporary files, and ``drain()`` returns."""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import signal
import stat
import threading

import pytest

import staging.copy as copy
from staging.checksum import LEAF_BYTES
from staging.manifest import Journal, Manifest, meta_dir
from staging.plan import Item


def test_a_failing_syncfs_is_an_error_not_a_hang(tmp_path, monkeypatch):
    dest = str(tmp_path / "dest")
    os.makedirs(meta_dir(dest), exist_ok=True)

    def broken_syncfs(path: str) -> None:
        # The kernel call cannot be made to fail on demand; this is the error it returns.
        raise OSError(errno.EIO, os.strerror(errno.EIO), path)

    monkeypatch.setattr(copy, "syncfs", broken_syncfs)
    committer = copy.Committer(dest, Journal(dest, 0))
    tmp = tmp_path / "dest" / "a.part"
    tmp.write_bytes(b"abc")
    committer.add(str(tmp), "a", {"source": "/src/a"}, 3)
    done = threading.Event()
    threading.Thread(target=lambda: (committer.drain(), done.set()), daemon=True).start()
    assert done.wait(10), "drain() hung after syncfs failed"
    committer.close()
    assert committer.errors == ["/src/a: cannot make a durable: Input/output error"]
    assert not tmp.exists() and not (tmp_path / "dest" / "a").exists()


def test_a_large_file_failing_at_its_commit_is_named_and_resumable(tmp_path, monkeypatch, capsys):
    """The last leaf of a file over ``LEAF_BYTES`` commits it; a failure there (here the
    file's mode, which cannot be made to fail on demand for root) is the file's error, exit
    non-zero, no traceback, and its finished leaves are resumed by the next run."""
    from datastore.cli import main

    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(1 << 20) * (LEAF_BYTES // (1 << 20) + 3)  # 2 leaves
    (src / "big.bin").write_bytes(data)
    dest = tmp_path / "dest"
    real = os.fchmod

    def broken_fchmod(fd: int, mode: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fchmod", broken_fchmod)
    code = main(["stage", str(src), "--to", str(dest), "--quiet", "--json"])
    said = capsys.readouterr()
    assert code != 0 and "Traceback" not in said.err, said.err
    assert json.loads(said.out)["errors"] == [f"{src / 'big.bin'}: Input/output error"]
    assert not (dest / "src" / "big.bin").exists() and not (dest / "big.bin").exists()
    monkeypatch.setattr(os, "fchmod", real)
    assert main(["stage", str(src), "--to", str(dest), "--quiet", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["resumed_bytes"] == len(data), out
    placed = [p for p in dest.rglob("big.bin")]
    assert len(placed) == 1 and placed[0].read_bytes() == data


def test_a_journal_that_cannot_grow_leaves_no_file_unrecorded(tmp_path):
    """A full disk as the journal is written (here the file size limit: the same short
    write, then an error): the batch's files are named and taken from their names, and the
    journal stays whole for the next batch. It used to keep them placed but unrecorded (a
    re-run, ``--verify`` and shard clean-up never knew them; 47 of 151 so on an 8 MiB tmpfs)
    and to end the run with an internal error when the journal closed."""
    dest = str(tmp_path / "dest")
    os.makedirs(meta_dir(dest))
    journal = Journal(dest, 0)
    committer = copy.Committer(dest, journal)

    def add(name: str) -> None:
        tmp = os.path.join(dest, f"{name}.part")
        with open(tmp, "wb") as f:
            f.write(name.encode())
        committer.add(tmp, name, {"entry": name, "kind": "file", "source": f"/src/{name}"}, 1)

    add("a")
    committer.drain()
    size = os.path.getsize(os.path.join(meta_dir(dest), "journal-0.jsonl"))
    add("b")
    add("c")
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    ignored = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 10, limit[1]))  # 10 bytes more
    try:
        committer.drain()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, ignored)
    add("d")
    committer.close()
    journal.close()
    why = os.strerror(errno.EFBIG)
    assert committer.errors == [
        f"/src/b: cannot record b: {why}",
        f"/src/c: cannot record c: {why}",
    ]
    assert sorted(os.listdir(dest)) == [".datastore", "a", "d"]
    assert sorted(Manifest.load(dest).entries) == ["a", "d"]
    assert (committer.placed.files, committer.placed.bytes) == (2, 2)


@pytest.mark.parametrize("size", [1000, LEAF_BYTES + (1 << 20)])
def test_a_source_written_while_copied_is_named_not_placed(tmp_path, monkeypatch, capsys, size):
    """A source file appended to while its copy runs: the copy is not placed (it may hold
    parts of two states, and would be recorded as the first), the file is named, exit 1, and
    a re-run stages what is there now. A 100 MB file grown by 5 MB mid-copy used to be
    placed as its first 100 MB, exit 0 (and `--verify` found nothing wrong)."""
    from datastore.cli import main

    src = tmp_path / "src"
    src.mkdir()
    grown, other = src / "grown.bin", src / "other.bin"
    grown.write_bytes(os.urandom(size))
    other.write_bytes(b"other\n")
    before = os.stat(grown)
    real = copy.copy_range

    def then_append(source, *args, **kwargs):
        digest = real(source, *args, **kwargs)
        if os.readlink(f"/proc/self/fd/{source.fd}") == str(grown) and grown.stat().st_size == size:
            with open(grown, "ab") as f:
                f.write(b"more")
        return digest

    monkeypatch.setattr(copy, "copy_range", then_append)
    dest = tmp_path / "dest"
    code = main(["stage", str(src), "--to", str(dest), "--quiet", "--json"])
    now = os.stat(grown)
    assert code == 1
    assert json.loads(capsys.readouterr().out)["errors"] == [
        f"{grown}: changed while being copied (size:mtime_ns {size}:{before.st_mtime_ns}, "
        f"then {size + 4}:{now.st_mtime_ns}); not placed"
    ]
    assert sorted(os.listdir(dest / "src")) == ["other.bin"]
    monkeypatch.setattr(copy, "copy_range", real)
    assert main(["stage", str(src), "--to", str(dest), "--quiet"]) == 0
    assert (dest / "src" / "grown.bin").read_bytes() == grown.read_bytes()


def test_a_directory_swapped_for_a_link_mid_run_takes_no_file_and_no_mode(tmp_path):
    """DEST/d held a file when a link took its place: the link was checked once, by path, so
    the rest of the run went where it pointed (19,985 of 20,000 files, exit 0), and the
    directories' modes and times were set on its target at the end."""
    dest, outside = tmp_path / "dest", tmp_path / "outside"
    os.makedirs(meta_dir(str(dest)))
    outside.mkdir(mode=0o700)
    committer = copy.Committer(str(dest), Journal(str(dest), 0))

    def add(name: str) -> None:
        tmp = dest / f"{name}.part"
        tmp.write_bytes(name.encode())
        committer.add(str(tmp), f"d/{name}", {"source": f"/src/d/{name}"}, 1)

    add("a")
    committer.drain()
    (dest / "d").rename(tmp_path / "moved")
    (dest / "d").symlink_to(outside)
    add("b")
    committer.close()
    assert committer.errors == [
        "/src/d/b: cannot place at d/b: refusing to write through a symlink"
    ]
    d = Item("d", "dir", "/src/d", "", mode=0o777, mtime_ns=10**18)
    errors = copy.settle_dirs(str(dest), [d], special_bits=False)
    assert errors == [
        "/src/d: cannot set the mode and time of d: refusing to write through a symlink"
    ]
    assert (os.listdir(outside), stat.S_IMODE(outside.stat().st_mode)) == ([], 0o700)
    assert os.listdir(tmp_path / "moved") == ["a"]


def _outside(root) -> dict:
    """Every entry under ``root``: its kind, mode and modification time."""
    return {
        str(p.relative_to(root)): (p.is_dir(), stat.S_IMODE(p.stat().st_mode), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
    }


def test_a_directory_swapped_for_a_link_mid_run_is_not_followed_to_mkdir_unlink_or_chmod(
    tmp_path, monkeypatch, capsys
):
    """A re-run that makes a directory, removes a file gone from the source and gives a file
    left in place its new mode, while a directory of DEST is swapped for a link out of it just
    before each call: by path, the directory was made, the file removed and the mode set
    where the link led. Through descriptors opened beneath DEST, nothing outside changes."""
    from datastore.cli import main

    src, dest, out = tmp_path / "src" / "ds", tmp_path / "dest", tmp_path / "outside"
    for d in ("keep", "gone", "new"):
        (src / d).mkdir(parents=True)
        (src / d / "f").write_bytes(d.encode())
        (out / d).mkdir(parents=True)
        (out / d / "f").write_bytes(b"outside")
        os.chmod(out / d / "f", 0o644)
    assert main(["stage", str(src), "--to", str(dest), "--quiet"]) == 0
    os.chmod(src / "keep" / "f", 0o600)  # kept in place: the re-run sets the mode
    shutil.rmtree(src / "gone")  # the re-run removes DEST/ds/gone/f
    (src / "new" / "x").mkdir()  # the re-run makes DEST/ds/new/x
    before = _outside(out)

    def swap(*names: str) -> None:
        for name in names:
            os.rename(dest / "ds" / name, tmp_path / f"moved-{name}")
            os.symlink(out / name, dest / "ds" / name)

    real_mkdir, real_unlink = os.mkdir, os.unlink

    def mkdir(path, *args, **kwargs):
        if os.path.basename(path) == "x":  # after the up-to-date check of DEST/ds/keep/f
            swap("new", "keep")
        return real_mkdir(path, *args, **kwargs)

    def unlink(path, *args, **kwargs):
        if os.path.basename(path) == "f":
            swap("gone")
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "unlink", unlink)
    code = main(["stage", str(src), "--to", str(dest), "--quiet", "--json"])
    monkeypatch.undo()
    assert _outside(out) == before
    why = "refusing to write through a symlink"
    assert (code, json.loads(capsys.readouterr().out)["errors"]) == (1, [
        f"{dest}/ds/keep/f: cannot set mode 600: {why}",
        f"{src}/new/x: cannot set the mode and time of ds/new/x: {why}",
        f"{src}/keep: cannot set the mode and time of ds/keep: {why}",
        f"{src}/new: cannot set the mode and time of ds/new: {why}",
    ])  # fmt: skip
    assert sorted(os.listdir(tmp_path / "moved-new")) == ["f", "x"]
    assert os.listdir(tmp_path / "moved-gone") == []


def test_temp_files_are_named_beneath_tmp_never_through_a_link(tmp_path, monkeypatch, capsys):
    """A link planted at a temp file's predictable name (``tmp/K/KEY.part``) as the engine
    names it, and ``tmp/K`` swapped for a link out of DEST: the temp files were opened by
    path with ``O_CREAT|O_TRUNC``, so the planted link's target was overwritten and the link
    itself placed in DEST (1,571 of 2,000 racing a real run, exit 0), and a swapped ``tmp/K``
    took the temp files written until their placement. Beneath the directory's descriptor, a
    link at the name is refused, named, and nothing outside DEST changes."""
    from datastore.cli import main

    src, dest, out = tmp_path / "src" / "ds", tmp_path / "dest", tmp_path / "outside"
    src.mkdir(parents=True)
    (src / "planted").write_bytes(b"new")
    (src / "swapped").write_bytes(b"new too")
    out.mkdir()
    (out / "victim").write_bytes(b"victim")
    real_tmp_path, real_place, seen = copy.Engine._tmp_path, copy._place, []

    def tmp_path_then_link(engine, item, ahead=False):
        path = real_tmp_path(engine, item, ahead)
        tmp = dest / ".datastore" / "tmp" / copy.tmp_subdir(os.path.basename(path))
        if item.dest == "ds/planted":
            os.symlink(out / "victim", tmp / os.path.basename(path))
        elif not tmp.is_symlink():
            tmp.rename(tmp_path / f"moved-{tmp.name}")
            tmp.symlink_to(out, target_is_directory=True)
        return path

    def place(*args) -> None:
        seen.append(os.listdir(out))
        real_place(*args)

    monkeypatch.setattr(copy.Engine, "_tmp_path", tmp_path_then_link)
    monkeypatch.setattr(copy, "_place", place)
    before = _outside(out)
    code = main(["stage", str(src), "--to", str(dest), "--quiet", "--json"])
    assert (code, json.loads(capsys.readouterr().out)["errors"]) == (
        1, [f"{src}/planted: refusing to write through a symlink"]
    )  # fmt: skip
    assert (_outside(out), seen) == (before, [["victim"]])
    assert sorted(os.listdir(dest / "ds")) == ["swapped"]
    assert (dest / "ds" / "swapped").read_bytes() == b"new too"


def test_an_empty_tree_a_file_replaces_is_removed_beneath_dest_only(tmp_path, monkeypatch, capsys):
    """A file of the source where an earlier run staged an empty directory tree: the tree
    goes, a directory at a time. One of its directories swapped for a link once the tree was
    checked: by path (``/proc/self/fd/N/x/sub/deep``), the empty directory the link led to
    was removed; beneath DEST the link is refused, named, and nothing outside changes."""
    from datastore.cli import main

    src, dest, out = tmp_path / "src" / "ds", tmp_path / "dest", tmp_path / "outside"
    (src / "x" / "sub" / "deep").mkdir(parents=True)
    (out / "deep").mkdir(parents=True)
    assert main(["stage", str(src), "--to", str(dest), "--quiet"]) == 0
    shutil.rmtree(src / "x")
    (src / "x").write_bytes(b"a file now")
    real = copy._dirs_only

    def then_swap(*args):
        tree = real(*args)
        (dest / "ds" / "x" / "sub").rename(tmp_path / "moved")
        (dest / "ds" / "x" / "sub").symlink_to(out, target_is_directory=True)
        return tree

    monkeypatch.setattr(copy, "_dirs_only", then_swap)
    code = main(["stage", str(src), "--to", str(dest), "--quiet", "--json"])
    assert (code, json.loads(capsys.readouterr().out)["errors"]) == (
        1, [f"{src}/x: cannot place at ds/x: refusing to write through a symlink"]
    )  # fmt: skip
    assert os.listdir(out) == ["deep"]
    monkeypatch.undo()
    (dest / "ds" / "x" / "sub").unlink()
    assert main(["stage", str(src), "--to", str(dest), "--quiet"]) == 0
    assert (dest / "ds" / "x").read_bytes() == b"a file now"


def test_a_refused_run_removes_what_it_made_for_dest_never_through_a_link(
    tmp_path, monkeypatch, capsys
):
    """A run whose every source is refused removes the directories it made for DEST, and its
    lock. A directory it made (DEST) swapped for a link to another DEST meanwhile: by path,
    that other DEST's lock was removed (a stage holding it no longer kept others out); now
    only the directories it made are opened, beneath the one above them, none through a link."""
    import staging.stage as stage_mod
    from datastore.cli import main

    dest, other = tmp_path / "new" / "dest", tmp_path / "other"
    (other / ".datastore").mkdir(parents=True)
    (other / ".datastore" / "lock").write_bytes(b"")
    (other / ".datastore" / "held").write_bytes(b"other")
    real = stage_mod.build_plan

    def then_swap(*args, **kwargs):
        plan = real(*args, **kwargs)
        dest.rename(tmp_path / "moved")
        dest.symlink_to(other, target_is_directory=True)
        return plan

    monkeypatch.setattr(stage_mod, "build_plan", then_swap)
    before = _outside(other)
    assert main(["stage", str(tmp_path / "missing"), "--to", str(dest), "--quiet"]) == 2
    assert "source not found" in capsys.readouterr().err
    assert _outside(other) == before


def _tree(root) -> dict:
    """Every entry under ``root``: a file's bytes, a link's target, ``"dir"``."""
    return {
        str(p.relative_to(root)): (
            os.readlink(p) if p.is_symlink() else "dir" if p.is_dir() else p.read_bytes()
        )
        for p in sorted(root.rglob("*"))
    }


def _other_dest(root):
    """Another stage's DEST: its manifest, lock, a partial copy it resumes and a temp file."""
    meta = root / ".datastore"
    (meta / "tmp" / "0").mkdir(parents=True)
    (meta / "manifest.json").write_text('{"version": 1, "entries": {}}')
    (meta / "lock").write_bytes(b"")
    (meta / "tmp" / "0" / "0123456789abcdef0123.part").write_bytes(b"another stage's copy")
    (meta / "tmp" / "0" / "0123456789abcdef0123.leaves").write_bytes(b"/elsewhere/b 1:2 xxh3\n")
    (meta / "tmp" / "other-file").write_bytes(b"x")
    return _tree(root)


@pytest.mark.parametrize("when", ["before the run", "dangling", "after the copy"])
def test_a_link_where_dest_datastore_belongs_is_refused_the_other_dest_unchanged(
    tmp_path, monkeypatch, capsys, when
):
    """``DEST/.datastore`` a link to another DEST's (there before the run, or swapped in once
    the copy is done): by path, the run emptied that DEST's ``tmp/`` (its partial copies
    gone) and wrote its manifest there, exit 0; now ``.datastore`` is opened once, never
    through a link, and the run refuses it in one line, the other DEST unchanged. A dangling
    link there was 'cannot prepare destination (File exists)', from ``makedirs``."""
    from datastore.cli import main

    src, dest, other = tmp_path / "src" / "ds", tmp_path / "dest", tmp_path / "other"
    src.mkdir(parents=True)
    (src / "f").write_bytes(b"f")
    before = _other_dest(other)
    if when == "before the run":
        dest.mkdir()
        (dest / ".datastore").symlink_to(other / ".datastore", target_is_directory=True)
        message, code = "cannot prepare destination (refusing to write through a symlink", 1
    elif when == "dangling":
        dest.mkdir()
        (dest / ".datastore").symlink_to(tmp_path / "gone", target_is_directory=True)
        message, code = "cannot prepare destination (refusing to write through a symlink", 1
    else:
        real = copy.Engine.run

        def run_then_swap(self, groups):
            stats = real(self, groups)
            (dest / ".datastore").rename(tmp_path / "moved")
            (dest / ".datastore").symlink_to(other / ".datastore", target_is_directory=True)
            return stats

        monkeypatch.setattr(copy.Engine, "run", run_then_swap)
        message, code = "cannot save the manifest: refusing to write through a symlink", 1
    assert main(["stage", str(src), "--to", str(dest), "--quiet"]) == code
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and f"{dest}: {message}: {dest}/.datastore" in err[0]
    assert _tree(other) == before and not (tmp_path / "gone").exists()


def test_tmp_swapped_for_a_link_after_the_plan_is_refused_in_one_line_nothing_placed(
    tmp_path, monkeypatch, capsys
):
    """``DEST/.datastore/tmp`` swapped for a link to another DEST's once the plan is made: by
    path, the scan for partial copies this run does not resume removed that DEST's (and the
    copy then failed file by file, each named by its source); now the scan opens ``tmp/``
    beneath ``.datastore``'s descriptor and the run stops there in one line naming it,
    nothing placed, the other DEST unchanged."""
    import staging.stage as stage_mod
    from datastore.cli import main

    src, dest, other = tmp_path / "src" / "ds", tmp_path / "dest", tmp_path / "other"
    src.mkdir(parents=True)
    for k in range(3):
        (src / f"f{k}").write_bytes(bytes([k]) * 100)
    before = _other_dest(other)
    real = stage_mod.build_plan

    def plan_then_swap(*args, **kwargs):
        plan = real(*args, **kwargs)
        (dest / ".datastore" / "tmp").rename(tmp_path / "moved")
        (dest / ".datastore" / "tmp").symlink_to(other / ".datastore" / "tmp")
        return plan

    monkeypatch.setattr(stage_mod, "build_plan", plan_then_swap)
    assert main(["stage", str(src), "--to", str(dest), "--quiet"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"datastore stage: error: {dest}: refusing to write through a symlink: "
        f"{dest}/.datastore/tmp"
    ]
    assert _tree(other) == before
    assert not dest.exists()  # the run made DEST: nothing of it is left


class _Rank1:
    """Rank 1 of a 2-rank world on one node (its own ``node_comm`` too): ``allgather`` gives
    both ranks this rank's object, ``bcast`` the leader's ``answers`` in turn."""

    def __init__(self, answers):
        self.answers, self.gathered = list(answers), []

    def allgather(self, obj):
        self.gathered.append(obj)
        return [obj, obj]

    def bcast(self, obj, root=0):
        return self.answers.pop(0)


def test_a_link_swapped_in_before_another_rank_opens_dest_datastore_is_refused_on_every_rank(
    tmp_path, monkeypatch, capsys
):
    """``DEST/.datastore`` swapped for a link once the leader opened it: a rank of the node
    other than the leader opened it by path building its Engine, which raised there (under
    mpiexec: 'internal error: PermissionError: [Errno 1] ...' and MPI_Abort); now it opens it
    before the space check and its refusal is in the status every rank agrees on, exit 1."""
    import staging.stage as stage_mod
    from staging.cluster import Layout
    from staging.config import StageConfig
    from staging.plan import Group, Item

    dest, other = tmp_path / "dest", tmp_path / "other"
    before = _other_dest(other)
    dest.mkdir()
    (dest / ".datastore").symlink_to(other / ".datastore", target_is_directory=True)
    item = Item("ds/f", "file", str(tmp_path / "f"), "1:1", size=1, path=str(tmp_path / "f"))
    work = stage_mod.NodeWork(per_rank=[[], [Group(item.source, (item,))]], todo_bytes=1)
    comm = _Rank1([True, ([], None), work])
    monkeypatch.setattr(stage_mod, "layout", lambda c, r: (Layout(1, 2, 0, 1, 1, 2), c))
    monkeypatch.setattr(stage_mod, "_node_groups", lambda *args: [])
    cfg = StageConfig(dest=str(dest), sources=(str(tmp_path / "f"),), quiet=True)
    assert stage_mod.stage(cfg, comm) == 1
    why = f"refusing to write through a symlink: {dest}/.datastore"
    assert comm.gathered[-1] == (1, f"{dest}: cannot prepare destination ({why})", None, 0)
    assert _tree(other) == before and capsys.readouterr().err == ""


@pytest.mark.parametrize("name", ["manifest.json", "lock", "journal-1.jsonl"])
def test_a_link_among_dest_datastores_files_is_refused_naming_it(tmp_path, capsys, name):
    """A link where a file of ``DEST/.datastore`` belongs: never followed, but the run said
    'cannot prepare destination (Too many levels of symbolic links)', naming nothing."""
    from datastore.cli import main

    src, dest, other = tmp_path / "src" / "ds", tmp_path / "dest", tmp_path / "other"
    src.mkdir(parents=True)
    (src / "f").write_bytes(b"f")
    before = _other_dest(other)
    (dest / ".datastore").mkdir(parents=True)
    (dest / ".datastore" / name).symlink_to(other / ".datastore" / "lock")
    assert main(["stage", str(src), "--to", str(dest), "--quiet"]) == 1
    why = f"refusing to open through a symlink: {dest}/.datastore/{name}"
    assert capsys.readouterr().err == (
        f"datastore stage: error: {dest}: cannot prepare destination ({why})\n"
    )
    assert _tree(other) == before and not (dest / "ds").exists()
