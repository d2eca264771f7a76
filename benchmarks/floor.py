"""The device floor of a copy: the same bytes moved as bare as Python can move them.

``python benchmarks/floor.py SRC OUT [THREADS]`` copies a directory tree, or the members of an
uncompressed tar, to OUT with parallel ``O_DIRECT`` reads (tar members in runs of up to 8 MiB)
and ``O_DIRECT`` writes from reused aligned buffers: no checksum, no manifest, no atomic
rename, no safety check. The tar's member list is read before the clock starts. Prints
``floor_seconds=S`` for the copy plus a final ``sync``: what the device allows, against
which both ``datastore stage`` and the peer tool can be judged.
"""

from __future__ import annotations

import mmap
import os
import sys
import tarfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

RUN = 8 << 20
ALIGN = 4096
_local = threading.local()


def _buf() -> memoryview:
    if not hasattr(_local, "buf"):
        _local.buf = memoryview(mmap.mmap(-1, RUN + 2 * ALIGN))
    return _local.buf


def _write(path: str, view: memoryview) -> None:
    n = len(view)
    padded = (n + ALIGN - 1) & ~(ALIGN - 1)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        if padded != n:
            tail = memoryview(mmap.mmap(-1, padded))
            tail[:n] = view
            view = tail
        os.pwrite(fd, view, 0)
        os.ftruncate(fd, n)
    finally:
        os.close(fd)


def tree_jobs(src: str, out: str) -> list:
    jobs = []
    for dirpath, _, names in os.walk(src):
        rel = os.path.relpath(dirpath, src)
        os.makedirs(os.path.join(out, rel), exist_ok=True)
        jobs += [(os.path.join(dirpath, n), os.path.join(out, rel, n)) for n in names]

    def copy(job: tuple[str, str]) -> None:
        fd = os.open(job[0], os.O_RDONLY | os.O_DIRECT)
        try:
            n = os.preadv(fd, [_buf()[: RUN + ALIGN]], 0)
        finally:
            os.close(fd)
        _write(job[1], _buf()[:n])

    return [(copy, j) for j in jobs]


def tar_jobs(src: str, out: str) -> list:
    with tarfile.open(src) as tf:
        members = [(m.name, m.offset_data, m.size) for m in tf if m.isreg()]
    for name, _, _ in members:
        os.makedirs(os.path.join(out, os.path.dirname(name)), exist_ok=True)
    runs, run = [], []
    for m in members:
        if run and m[1] + m[2] - run[0][1] > RUN:
            runs.append(run)
            run = []
        run.append(m)
    runs.append(run)
    fd = os.open(src, os.O_RDONLY | os.O_DIRECT)

    def copy(run: list) -> None:
        base = run[0][1] & ~(ALIGN - 1)
        end = run[-1][1] + run[-1][2]
        buf = _buf()
        os.preadv(fd, [buf[: (end - base + ALIGN - 1) & ~(ALIGN - 1)]], base)
        for name, off, size in run:
            _write(os.path.join(out, name), buf[off - base : off - base + size])

    return [(copy, r) for r in runs]


def main() -> int:
    if len(sys.argv) not in (3, 4) or sys.argv[1].startswith("-"):
        print("usage: python benchmarks/floor.py SRC OUT [THREADS]", file=sys.stderr)
        return 2
    src, out = sys.argv[1], sys.argv[2]
    threads = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    jobs = tar_jobs(src, out) if src.endswith(".tar") else tree_jobs(src, out)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        for fut in [pool.submit(f, j) for f, j in jobs]:
            fut.result()
    os.sync()
    print(f"floor_seconds={time.perf_counter() - t0:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
