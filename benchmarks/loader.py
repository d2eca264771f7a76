"""Benchmark ``DataStoreLoader`` against the stock PyTorch DataLoader, and its parts.

What is measured
----------------
Datasets of N samples (``--samples``, default 192) of 4 MiB each: ``x`` float32 (4, 64, 64, 64)
and ``y`` float32 (4,), written once under ``--dir`` (default ``./bench-data/loader``) as

  * ``samples.h5``: one HDF5 file, leading sample axis, ``x`` chunked one sample per chunk;
  * ``slabs.h5``: the same data, ``x`` chunked (1, 4, 8, 64, 64) (depth slabs of 512 KiB);
  * ``npy/x/``: one ``.npy`` file per sample (``x`` only), labels in ``npy/labels.npy``.

Four cases, all in one run:

1. **Loader vs stock DataLoader** (``samples.h5`` and ``npy/x``). Peer:
   ``torch.utils.data.DataLoader(ds, batch_size=8, shuffle=True, num_workers=2)`` over a
   map-style Dataset reading one sample per ``__getitem__`` (h5py opened lazily per worker;
   ``np.load`` per file), default collate. Ours: ``DataStoreLoader(path, batch_size=8, seed=0)``
   (it preloads the store while constructed: construction + epoch 1 is our "epoch 1").
   Each batch is consumed minimally (one element read), so data delivery is what is timed.
   Epoch 1 starts cold (``sync; echo 3 > /proc/sys/vm/drop_caches`` before constructing);
   epochs 2..E each start after dropping the cache again ("cold"); then one untimed warm-up
   epoch and epochs 2..E again without dropping ("warm"). Ratio = peer time / ours time.
   Targets: epoch 1 >= 1.0x, epochs >= 2 cold >= 5x, warm >= 4x.
2. **Block reads** through the reader API (``open_dataset(path).read(i, "x", region, out)``),
   warm cache, preallocated outputs: block 0 with halo ``h`` of a depth split into k blocks
   (``full_region(Grid((64, 64, 64), (k, 1, 1), (h, 0, 0)), 0, 4, (1, 2, 3))``) of every sample
   vs every full sample, k in 2, 4, 8, for the three datasets.
   Target: block time <= 1.25 x (1/k + 2h/D) x full time.
3. **MPI exchange share**: ``mpiexec -n R python -m mpi4py benchmarks/exchange_job.py`` for
   R = 2 and 4 over ``samples.h5``: global batch 8 per rank, 2 epochs, a simulated compute step
   of ``--compute-ms`` per batch. Exchange time (``counters.exchange_seconds``) and consumer wait
   (``counters.wait_seconds``) as shares of the iteration's wall time, the slowest rank.
   Target: exchange <= 10% of batch time.
4. **Store RSS / raw bytes**: in a fresh process, VmRSS before and after constructing a
   preloaded ``DataStoreLoader`` over ``samples.h5``; (RSS increase) / (raw bytes stored).
   Target <= 1.1.

The ceiling printed with the results is the machine's memcpy bandwidth into a reused buffer
(``numpy.copyto`` of 256 MiB into an existing array, median of 5). GB/s are 10^9 bytes of ``x``
per second. Repetitions (``--reps``) alternate which side runs first; medians are reported.

Usage::

    python benchmarks/loader.py                  # full run (~6 min on 2 cores)
    python benchmarks/loader.py --quick          # smoke run: N=48, 1 rep
    python benchmarks/loader.py --cases 1,4 --out /tmp/loader.md
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import h5py
import numpy as np
import torch
from common import PageCache, machine_info, venv_tool
from torch.utils.data import DataLoader, Dataset

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
XSHAPE = (4, 64, 64, 64)
YSHAPE = (4,)
XBYTES = int(np.prod(XSHAPE)) * 4
DEPTH = XSHAPE[1]
SLAB_CHUNKS = (1, 4, 8, 64, 64)
BATCH = 8
WORKERS = 2
KS = (2, 4, 8)
RANKS = (2, 4)
MEMCPY_BYTES = 256 * MIB
LAYOUT_VERSION = 1
TARGETS = {"epoch1": 1.0, "cold": 5.0, "warm": 4.0}
EXCHANGE_TARGET = 0.10
RSS_TARGET = 1.1
BLOCK_SLACK = 1.25
HERE = os.path.dirname(os.path.abspath(__file__))


# ----------------------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="./bench-data/loader", help="where the datasets are written")
    p.add_argument("--samples", type=int, default=None, help="samples N (default 192; 48 quick)")
    p.add_argument("--epochs", type=int, default=3, help="epochs E per loader run (default 3)")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 3; 1 quick)")
    p.add_argument("--halo", type=int, default=2, help="halo h along depth for case 2")
    p.add_argument("--compute-ms", type=float, default=50.0, help="simulated compute per batch")
    p.add_argument("--cases", default="1,2,3,4", help="cases to run, comma separated")
    p.add_argument("--quick", action="store_true", help="smoke run: N=48, reps 1")
    p.add_argument("--warm", action="store_true", help="never drop the page cache")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the report here")
    p.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.samples is None:
        args.samples = 48 if args.quick else 192
    if args.reps is None:
        args.reps = 1 if args.quick else 3
    args.cases = sorted({c.strip() for c in args.cases.split(",") if c.strip()})
    bad = [c for c in args.cases if c not in ("1", "2", "3", "4")]
    if bad or not args.cases:
        p.error(f"--cases: unknown case(s) {bad}; pick from 1,2,3,4")
    if args.samples < BATCH * max(RANKS) or args.reps < 1 or args.epochs < 2:
        p.error(f"need --samples >= {BATCH * max(RANKS)}, --reps >= 1 and --epochs >= 2")
    if not 0 <= args.halo <= DEPTH // max(KS):
        p.error(f"--halo must be in [0, {DEPTH // max(KS)}]")
    return args


# ----------------------------------------------------------------------------- datasets


@dataclass(frozen=True)
class Paths:
    h5: str  # one chunk per sample
    slabs: str  # chunks (1, 4, 8, 64, 64)
    npy: str  # directory of per-sample .npy files (x only)
    labels: str  # the labels of the npy dataset


def data_paths(work: str) -> Paths:
    return Paths(
        os.path.join(work, "samples.h5"),
        os.path.join(work, "slabs.h5"),
        os.path.join(work, "npy", "x"),
        os.path.join(work, "npy", "labels.npy"),
    )


def npy_files(d: str) -> list[str]:
    return [os.path.join(d, n) for n in sorted(os.listdir(d)) if n.endswith(".npy")]


def ensure_data(work: str, n: int) -> Paths:
    """Write the three datasets unless a stamp says they are there with ``n`` samples."""
    paths = data_paths(work)
    stamp = os.path.join(work, "data.json")
    want = {"samples": n, "layout": LAYOUT_VERSION}
    try:
        with open(stamp) as f:
            ok = json.load(f) == want
        ok = ok and all(os.path.exists(p) for p in (paths.h5, paths.slabs, paths.labels))
        ok = ok and len(npy_files(paths.npy)) == n
    except (OSError, ValueError):
        ok = False
    if ok:
        return paths
    need = 3 * n * XBYTES + 64 * MIB
    have = shutil.disk_usage(work).free
    if have < need:
        sys.exit(f"{work}: {have / GIB:.1f} GiB free, the datasets need {need / GIB:.1f} GiB")
    print(f"generating {n} samples x {XBYTES / MIB:.0f} MiB in 3 formats under {work} ...")
    for p in (stamp, paths.h5, paths.slabs):
        if os.path.exists(p):
            os.remove(p)
    shutil.rmtree(os.path.dirname(paths.npy), ignore_errors=True)
    os.makedirs(paths.npy)
    rng = np.random.default_rng(0)
    y = rng.random((n, *YSHAPE), dtype=np.float32)
    with h5py.File(paths.h5, "w") as a, h5py.File(paths.slabs, "w") as b:
        xa = a.create_dataset("x", (n, *XSHAPE), "f4", chunks=(1, *XSHAPE))
        xb = b.create_dataset("x", (n, *XSHAPE), "f4", chunks=SLAB_CHUNKS)
        a.create_dataset("y", data=y)
        b.create_dataset("y", data=y)
        x = np.empty(XSHAPE, np.float32)
        for i in range(n):
            rng.random(XSHAPE, dtype=np.float32, out=x)
            xa[i] = x
            xb[i] = x
            np.save(os.path.join(paths.npy, f"s{i:06d}.npy"), x)
    np.save(paths.labels, y)
    os.sync()
    with open(stamp, "w") as f:
        json.dump(want, f)
    return paths


def npy_spec(paths: Paths) -> Any:
    """The npy directory as a dataset: field ``x`` with spatial axes (1, 2, 3)."""
    from datastore.readers.spec import DatasetSpec, FieldSpec

    return DatasetSpec("npy", (paths.npy,), (FieldSpec("x", (1, 2, 3)),))


# ----------------------------------------------------------------------------- the peer


class H5Samples(Dataset):
    """One sample per ``__getitem__`` from an HDF5 file opened lazily in each worker."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.file: h5py.File | None = None
        with h5py.File(path, "r") as f:
            self.n = len(f["x"])

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if self.file is None:
            self.file = h5py.File(self.path, "r")
        return {"x": self.file["x"][i], "y": self.file["y"][i]}


class NpySamples(Dataset):
    """One ``np.load`` per ``__getitem__``; labels from one small array."""

    def __init__(self, directory: str, labels: str) -> None:
        self.files = npy_files(directory)
        self.labels = np.load(labels)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {"x": np.load(self.files[i]), "y": self.labels[i]}


# ----------------------------------------------------------------------------- cache, timing


def consume(batches: Iterable[dict[str, torch.Tensor]]) -> int:
    """Iterate, touching one element of each batch; the number of samples delivered."""
    n = 0
    for batch in batches:
        x = batch["x"]
        float(x[0, 0, 0, 0, 0])
        n += x.shape[0]
    return n


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def memcpy_ceiling() -> float:
    """GB/s of ``numpy.copyto`` of 256 MiB into an existing (touched) array, median of 5."""
    src = np.ones(MEMCPY_BYTES // 4, np.float32)
    dst = np.zeros_like(src)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return MEMCPY_BYTES / median(times) / 1e9


# ----------------------------------------------------------------------------- case 1


@dataclass
class LoaderRuns:
    """Times of one format, both sides: ``times[side][phase]`` lists of seconds."""

    fmt: str
    times: dict[str, dict[str, list[float]]] = field(
        default_factory=lambda: {
            s: {"epoch1": [], "cold": [], "warm": [], "construct": []} for s in ("ours", "peer")
        }
    )


def epochs_of(
    make: Callable[[], Iterable[dict[str, torch.Tensor]]],
    epochs: int,
    cache: PageCache,
    want: int,
    side: str,
) -> dict[str, Any]:
    """Epoch 1 cold (creation included), epochs 2..E cold, warm-up, epochs 2..E warm."""
    out: dict[str, Any] = {"cold": [], "warm": []}

    def check(n: int) -> None:
        if n != want:
            raise SystemExit(f"{side}: an epoch delivered {n} samples, expected {want}")

    cache.drop()
    t0 = time.perf_counter()
    loader = make()
    out["construct"] = time.perf_counter() - t0
    check(consume(loader))
    out["epoch1"] = time.perf_counter() - t0
    for _ in range(2, epochs + 1):
        cache.drop()
        t0 = time.perf_counter()
        check(consume(loader))
        out["cold"].append(time.perf_counter() - t0)
    consume(loader)  # untimed warm-up: every page of the dataset is in the cache now
    for _ in range(2, epochs + 1):
        t0 = time.perf_counter()
        check(consume(loader))
        out["warm"].append(time.perf_counter() - t0)
    close = getattr(loader, "close", None)
    if close is not None:
        close()
    del loader
    gc.collect()
    return out


def run_case1(args: argparse.Namespace, paths: Paths, cache: PageCache) -> list[LoaderRuns]:
    from datastore import DataStoreLoader

    n = args.samples
    want = n - n % BATCH  # both sides: 8 per batch; ours drops a partial last batch
    formats = {
        "hdf5": (
            lambda: DataStoreLoader(paths.h5, batch_size=BATCH, seed=0),
            lambda: DataLoader(
                H5Samples(paths.h5),
                batch_size=BATCH,
                shuffle=True,
                num_workers=WORKERS,
                drop_last=True,
            ),
        ),
        "npy": (
            lambda: DataStoreLoader(npy_spec(paths), batch_size=BATCH, seed=0),
            lambda: DataLoader(
                NpySamples(paths.npy, paths.labels),
                batch_size=BATCH,
                shuffle=True,
                num_workers=WORKERS,
                drop_last=True,
            ),
        ),
    }
    torch.manual_seed(0)
    print(
        f"\n[1] loader vs torch DataLoader(batch_size={BATCH}, shuffle=True, "
        f"num_workers={WORKERS}): {n} samples, {args.epochs} epochs, {args.reps} rep(s)",
        flush=True,
    )
    results = []
    for fmt, (ours, peer) in formats.items():
        runs = LoaderRuns(fmt)
        for rep in range(args.reps):
            order = ("ours", "peer") if rep % 2 == 0 else ("peer", "ours")
            line = []
            for side in order:
                got = epochs_of(ours if side == "ours" else peer, args.epochs, cache, want, side)
                t = runs.times[side]
                t["epoch1"].append(got["epoch1"])
                t["construct"].append(got["construct"])
                t["cold"].extend(got["cold"])
                t["warm"].extend(got["warm"])
                line.append(
                    f"{side} e1 {got['epoch1']:.2f} s (create {got['construct']:.2f}), "
                    f"cold {' '.join(f'{v:.3f}' for v in got['cold'])}, "
                    f"warm {' '.join(f'{v:.3f}' for v in got['warm'])}"
                )
            print(f"  {fmt} rep {rep + 1}/{args.reps}: " + "; ".join(line), flush=True)
        results.append(runs)
    return results


# ----------------------------------------------------------------------------- case 2


@dataclass
class BlockRuns:
    fmt: str
    note: str
    full: list[float] = field(default_factory=list)
    block: dict[int, list[float]] = field(default_factory=dict)


def region_shape(region: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(len(range(*s.indices(n))) for s, n in zip(region, shape, strict=True))


def run_case2(args: argparse.Namespace, paths: Paths) -> list[BlockRuns]:
    from datastore.partition import Grid, full_region
    from datastore.readers import open_dataset

    n, h = args.samples, args.halo
    datasets = {
        "hdf5 (1 chunk/sample)": (paths.h5, "chunks (1, 4, 64, 64, 64), 4 MiB"),
        "hdf5 (depth slabs)": (paths.slabs, f"chunks {SLAB_CHUNKS}, 512 KiB"),
        "npy": (npy_spec(paths), "one .npy per sample"),
    }
    regions = {}
    for k in KS:
        read, _pad = full_region(Grid(XSHAPE[1:], (k, 1, 1), (h, 0, 0)), 0, len(XSHAPE), (1, 2, 3))
        regions[k] = read
    print(
        f"\n[2] block 0 (+halo {h}) of a depth split into k vs the full sample, reader API, "
        f"warm cache, {n} samples, {args.reps} rep(s)",
        flush=True,
    )
    results = []
    for fmt, (ds, note) in datasets.items():
        reader = open_dataset(ds)
        if len(reader) != n:
            raise SystemExit(f"{fmt}: reader sees {len(reader)} samples, expected {n}")
        full = np.empty(XSHAPE, np.float32)
        outs = {k: np.empty(region_shape(r, XSHAPE), np.float32) for k, r in regions.items()}

        def full_pass(reader: Any = reader, full: np.ndarray = full) -> float:
            t0 = time.perf_counter()
            for i in range(n):
                reader.read(i, "x", out=full)
            return time.perf_counter() - t0

        def block_pass(k: int, reader: Any = reader, outs: dict = outs) -> float:
            region, out = regions[k], outs[k]
            t0 = time.perf_counter()
            for i in range(n):
                reader.read(i, "x", region=region, out=out)
            return time.perf_counter() - t0

        # correctness, once: the block equals the slice of the full sample
        reader.read(n - 1, "x", out=full)
        for k in KS:
            reader.read(n - 1, "x", region=regions[k], out=outs[k])
            if not np.array_equal(outs[k], full[regions[k]]):
                raise SystemExit(f"{fmt}: block k={k} differs from the full sample's slice")
        full_pass()  # warm the page cache
        runs = BlockRuns(fmt, note, block={k: [] for k in KS})
        for rep in range(args.reps):
            jobs: list[Any] = [None, *KS]
            if rep % 2:
                jobs.reverse()
            for job in jobs:
                if job is None:
                    runs.full.append(full_pass())
                else:
                    runs.block[job].append(block_pass(job))
            print(
                f"  {fmt} rep {rep + 1}/{args.reps}: full {runs.full[-1]:.3f} s, "
                + ", ".join(f"k={k} {runs.block[k][-1]:.3f} s" for k in KS),
                flush=True,
            )
        reader.close()
        results.append(runs)
    return results


# ----------------------------------------------------------------------------- case 3


def run_case3(args: argparse.Namespace, paths: Paths) -> list[dict[str, Any]]:
    job = os.path.join(HERE, "exchange_job.py")
    print(
        f"\n[3] MPI exchange: global batch {BATCH} per rank, 2 epochs, "
        f"compute {args.compute_ms:g} ms per batch",
        flush=True,
    )
    results = []
    for r in RANKS:
        cmd = [
            venv_tool("mpiexec"), "-n", str(r), sys.executable, "-m", "mpi4py", job, paths.h5,
            "--batch", str(BATCH), "--epochs", "2", "--compute-ms", str(args.compute_ms),
        ]  # fmt: skip
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            results.append({"ranks": r, "error": "timed out after 600 s"})
            print(f"  R={r}: timed out", flush=True)
            continue
        wall = time.perf_counter() - t0
        line = next(
            (ln for ln in proc.stdout.splitlines() if ln.startswith("EXCHANGE_JSON ")), None
        )
        if proc.returncode != 0 or line is None:
            err = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-8:]
            results.append({"ranks": r, "error": f"exit {proc.returncode}: " + " | ".join(err)})
            print(f"  R={r}: FAILED (exit {proc.returncode})\n    " + "\n    ".join(err))
            continue
        res = json.loads(line.split(" ", 1)[1])
        res["wall_s"] = wall
        per = res["per_rank"]
        res["exchange_share"] = max(p["exchange_seconds"] / p["total_s"] for p in per)
        res["wait_share"] = max(p["wait_seconds"] / p["total_s"] for p in per)
        res["steps"] = per[0]["steps"]
        res["batch_ms"] = max(p["total_s"] for p in per) / max(1, res["steps"]) * 1e3
        res["bytes_per_step"] = statistics.mean(
            p["bytes_exchanged"] / max(1, p["steps"]) for p in per
        )
        res["exchange_ms"] = max(p["exchange_seconds"] for p in per) / max(1, res["steps"]) * 1e3
        last = [p["epochs"][-1] for p in per]  # steady state: buffers touched, ranks in step
        res["last_exchange_share"] = max(e["exchange_seconds"] / e["total_s"] for e in last)
        res["last_wait_share"] = max(e["wait_seconds"] / e["total_s"] for e in last)
        res["last_batch_ms"] = max(e["total_s"] / max(1, e["steps"]) for e in last) * 1e3
        results.append(res)
        print(
            f"  R={r}: {res['steps']} steps, batch {res['batch_ms']:.1f} ms, exchange "
            f"{res['exchange_ms']:.1f} ms/step ({res['exchange_share']:.1%}), wait "
            f"{res['wait_share']:.1%}, {res['bytes_per_step'] / MIB:.1f} MiB sent/step/rank, "
            f"job wall {wall:.1f} s",
            flush=True,
        )
    return results


# ----------------------------------------------------------------------------- case 4


def vmrss() -> int:
    with open("/proc/self/status") as f:
        for ln in f:
            if ln.startswith("VmRSS:"):
                return int(ln.split()[1]) * KIB
    raise RuntimeError("no VmRSS in /proc/self/status")


def rss_child(path: str) -> int:
    """In this fresh process: RSS before/after a preloaded loader over ``path``; JSON out."""
    from datastore import DataStoreLoader
    from datastore.readers import open_dataset

    with open_dataset(path) as r:  # import and warm up whatever the reader needs
        r.read(0, "x")
    gc.collect()
    before = vmrss()
    loader = DataStoreLoader(path, batch_size=BATCH, seed=0, preload=True)
    after = vmrss()
    raw = len(loader.store.keys) * sum(
        int(np.prod(f.sample_shape)) * f.dtype.itemsize for f in loader.fields
    )
    consume(loader)
    after_epoch = vmrss()
    print(
        json.dumps(
            {
                "before": before,
                "after": after,
                "after_epoch": after_epoch,
                "raw": raw,
                "resident": loader.counters.bytes_resident,
                "ring": sum(a.nbytes for buf in loader._ring for a in buf.values()),
            }
        )
    )
    loader.close()
    return 0


def run_case4(paths: Paths) -> dict[str, Any]:
    print("\n[4] store RSS / raw bytes (fresh process, samples.h5, preload)", flush=True)
    cmd = [sys.executable, os.path.abspath(__file__), "--rss-child", paths.h5]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        err = proc.stderr.strip().splitlines()[-8:]
        print("  FAILED:\n    " + "\n    ".join(err))
        return {"error": f"exit {proc.returncode}: " + " | ".join(err)}
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["ratio"] = (res["after"] - res["before"]) / res["raw"]
    res["ratio_epoch"] = (res["after_epoch"] - res["before"]) / res["raw"]
    print(
        f"  RSS {res['before'] / MIB:.0f} -> {res['after'] / MIB:.0f} MiB "
        f"(after one epoch {res['after_epoch'] / MIB:.0f} MiB), raw {res['raw'] / MIB:.0f} MiB: "
        f"ratio {res['ratio']:.3f}",
        flush=True,
    )
    return res


# ----------------------------------------------------------------------------- report


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def gbs(nbytes: float, secs: float) -> str:
    return f"{nbytes / secs / 1e9:.2f} GB/s" if secs > 0 else "-"


PHASES = {
    "epoch1": "epoch 1, cold (ours: creation + preload + epoch)",
    "cold": "epochs >= 2, cache dropped",
    "warm": "epochs >= 2, warm cache",
}


def report(
    args: argparse.Namespace,
    ceiling: float,
    cache: PageCache,
    c1: list[LoaderRuns],
    c2: list[BlockRuns],
    c3: list[dict[str, Any]],
    c4: dict[str, Any] | None,
    work: str,
) -> str:
    n = args.samples
    payload = (n - n % BATCH) * XBYTES
    rows = [
        "| case | measure | ours | peer / reference | ratio | target | |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    notes: list[str] = []
    for runs in c1:
        for phase, title in PHASES.items():
            o, p = median(runs.times["ours"][phase]), median(runs.times["peer"][phase])
            ratio = p / o
            rows.append(
                f"| 1 loader, {runs.fmt} | {title} | {o:.3f} s ({gbs(payload, o)}) "
                f"| {p:.3f} s ({gbs(payload, p)}) | {ratio:.2f}x | >= {TARGETS[phase]:g}x "
                f"| {verdict(ratio >= TARGETS[phase])} |"
            )
        t = runs.times
        notes.append(
            f"- 1 {runs.fmt}: ours creation (preload) median {median(t['ours']['construct']):.3f}"
            f" s; spread ours/peer epoch 1 {min(t['ours']['epoch1']):.2f}-"
            f"{max(t['ours']['epoch1']):.2f} / {min(t['peer']['epoch1']):.2f}-"
            f"{max(t['peer']['epoch1']):.2f} s, cold {min(t['ours']['cold']):.3f}-"
            f"{max(t['ours']['cold']):.3f} / {min(t['peer']['cold']):.3f}-"
            f"{max(t['peer']['cold']):.3f} s"
        )
    h = args.halo
    for runs in c2:
        full = median(runs.full)
        for k in KS:
            b = median(runs.block[k])
            bound = BLOCK_SLACK * (1 / k + 2 * h / DEPTH)
            rows.append(
                f"| 2 block read, {runs.fmt} | block 0 of k={k}, halo {h} "
                f"| {b * 1e3:.1f} ms | full {full * 1e3:.1f} ms | {b / full:.3f} "
                f"| <= {bound:.3f} x full | {verdict(b <= bound * full)} |"
            )
        notes.append(
            f"- 2 {runs.fmt} ({runs.note}): full samples {gbs(n * XBYTES, full)}; "
            + ", ".join(f"k={k} block {median(runs.block[k]) / full:.3f} of full" for k in KS)
        )
    for res in c3:
        r = res["ranks"]
        if "error" in res:
            rows.append(
                f"| 3 MPI exchange | R={r} | error | - | - | <= {EXCHANGE_TARGET:.0%} | MISS |"
            )
            notes.append(f"- 3 R={r}: {res['error']}")
            continue
        share = res["exchange_share"]
        rows.append(
            f"| 3 MPI exchange | R={r}, exchange share of batch time (slowest rank) "
            f"| {share:.1%} ({res['exchange_ms']:.1f} ms/step) | batch {res['batch_ms']:.1f} ms "
            f"| {share:.3f} | <= {EXCHANGE_TARGET:.0%} | {verdict(share <= EXCHANGE_TARGET)} |"
        )
        expect = BATCH * (XBYTES + 16) * (r - 1) / r
        notes.append(
            f"- 3 R={r}: {res['steps']} steps, compute {res['compute_ms']:g} ms/step, consumer "
            f"wait {res['wait_share']:.1%} of batch time (slowest rank), sent "
            f"{res['bytes_per_step'] / MIB:.2f} MiB/step/rank (a uniform owner split predicts "
            f"{expect / MIB:.2f}), creation {max(p['construct_s'] for p in res['per_rank']):.2f}"
            f" s, job wall {res['wall_s']:.1f} s; last epoch alone: exchange "
            f"{res['last_exchange_share']:.1%}, wait {res['last_wait_share']:.1%}, batch "
            f"{res['last_batch_ms']:.1f} ms"
            + ("; oversubscribed: more ranks than cores" if r > (os.cpu_count() or 1) else "")
        )
    if c4 is not None:
        if "error" in c4:
            rows.append(
                f"| 4 store RSS | increase / raw | error | - | - | <= {RSS_TARGET} | MISS |"
            )
            notes.append(f"- 4: {c4['error']}")
        else:
            rows.append(
                f"| 4 store RSS | RSS increase / raw bytes stored "
                f"| {(c4['after'] - c4['before']) / MIB:.0f} MiB | raw {c4['raw'] / MIB:.0f} MiB "
                f"| {c4['ratio']:.3f} | <= {RSS_TARGET} | {verdict(c4['ratio'] <= RSS_TARGET)} |"
            )
            notes.append(
                f"- 4: after one epoch the increase is {c4['ratio_epoch']:.3f} x raw (the "
                f"loader's batch ring, {c4['ring'] / MIB:.0f} MiB, is touched by then)"
            )
    return (
        "\n".join(
            [
                *rows,
                "",
                "ratio: case 1 = peer time / ours time (> 1: we are faster); case 2 = block time"
                " / full time; cases 3, 4 = the figure itself.",
                *notes,
                "",
                f"- ceiling: memcpy into a reused buffer (numpy.copyto, 256 MiB, median of 5): "
                f"{ceiling:.2f} GB/s",
                f"- data: {n} samples x {XBYTES / MIB:.0f} MiB (x float32 {XSHAPE}, y float32 "
                f"{YSHAPE}); GB/s count x only; batch {BATCH}; epochs {args.epochs}; reps "
                f"{args.reps}; work dir {work}",
                f"- peer: torch DataLoader(batch_size={BATCH}, shuffle=True, "
                f"num_workers={WORKERS}), default collate; npy peer also loads labels, ours "
                "delivers x only for npy",
                f"- page cache: {cache.note}",
                "- machine: "
                + machine_info(f"torch {torch.__version__}", f"h5py {h5py.__version__}"),
            ]
        )
        + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rss_child:
        return rss_child(args.rss_child)
    t_start = time.perf_counter()
    work = os.path.abspath(args.dir)
    os.makedirs(work, exist_ok=True)
    paths = ensure_data(work, args.samples)
    cache = PageCache(args.warm)
    ceiling = memcpy_ceiling()
    print(f"ceiling: memcpy into a reused buffer {ceiling:.2f} GB/s", flush=True)
    c1 = run_case1(args, paths, cache) if "1" in args.cases else []
    c2 = run_case2(args, paths) if "2" in args.cases else []
    c3 = run_case3(args, paths) if "3" in args.cases else []
    c4 = run_case4(paths) if "4" in args.cases else None
    text = report(args, ceiling, cache, c1, c2, c3, c4, work)
    print("\n" + text, end="")
    print(f"(benchmark wall time {time.perf_counter() - t_start:.0f} s)")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
