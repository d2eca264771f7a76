"""Faults the copy engine must turn into errors, not hangs: a ``syncfs`` that fails leaves the
batch's files unplaced, names them, removes their temporary files, and ``drain()`` returns."""

from __future__ import annotations

import errno
import os
import threading

import staging.copy as copy
from staging.manifest import Journal, meta_dir


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
