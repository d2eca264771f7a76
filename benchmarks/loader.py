"""Benchmark ``DataStoreLoader`` against the stock PyTorch DataLoader, and its parts.

What is measured
----------------
Datasets of N samples (``--samples``, default 192) of 4 MiB each: ``x`` float32 (4, 64, 64, 64)
and ``y`` float32 (4,), written once under ``--dir`` (default ``./bench-data/loader``) as

  * ``samples.h5``: one HDF5 file, leading sample axis, ``x`` chunked one sample per chunk;
  * ``slabs.h5``: the same data, ``x`` chunked (1, 4, 8, 64, 64) (depth slabs of 512 KiB);
  * ``npy/x/``: one ``.npy`` file per sample (``x`` only), labels in ``npy/labels.npy``.

Four cases, all in one run:

1. **Loader vs stock DataLoader** (``samples.h5`` and ``npy/x``). Peers, configured as their
   users run them: ``torch.utils.data.DataLoader(ds, batch_size=8, shuffle=True,
   drop_last=True, persistent_workers=True, pin_memory=<CUDA available>)`` with each
   ``num_workers`` of ``--workers`` (default: the cores and twice the cores), over

   * **disk**: a map-style Dataset reading one sample per ``__getitem__`` (h5py opened lazily
     per worker; ``np.load`` per file), default collate: the peer for epoch 1;
   * **in memory**: the whole dataset read into RAM first (one array per field, read with h5py
     or ``np.load`` while the peer is constructed), a map-style Dataset indexing it, with each
     ``num_workers`` of ``--memory-workers`` (default: 0 and the cores): the like-for-like peer
     for epochs >= 2, where ours serves from RAM too.

   The fastest setting of each peer (lowest median, per phase) is the one compared; every
   setting's figures are printed. Ours: ``DataStoreLoader(path, batch_size=8, seed=0,
   pin_memory=<CUDA available>)`` (it preloads the store while constructed: construction +
   epoch 1 is our "epoch 1"; likewise the in-memory peer's reading). Each batch is consumed
   minimally (one element read), so data delivery is what is timed. Epoch 1 starts cold
   (``sync; echo 3 > /proc/sys/vm/drop_caches`` before constructing); epochs 2..E each start
   after dropping the cache again ("cold"); then one untimed warm-up epoch and epochs 2..E
   again without dropping ("warm"). Ratio = peer time / ours time. Targets: vs disk, epoch 1
   >= 1.0x, epochs >= 2 cold >= 5x, warm >= 4x; vs in memory, epochs >= 2 >= 1.0x.
2. **Block reads** through the reader API (``open_dataset(path).read(i, "x", region, out)``),
   warm cache, preallocated outputs: block 0 with halo ``h`` of a depth split into k blocks
   (``full_region(Grid((64, 64, 64), (k, 1, 1), (h, 0, 0)), 0, 4, (1, 2, 3))``) of every sample
   vs every full sample, k in 2, 4, 8, for the three datasets.
   Target: block time <= 1.25 x (1/k + 2h/D) x full time.
3. **MPI exchange share**: ``mpiexec -n R python -m mpi4py benchmarks/exchange_job.py`` for
   R = 2 and 4 over ``samples.h5``: global batch 8 per rank, 2 epochs, a simulated compute step
   per batch that burns CPU (a matrix-product loop calibrated to ``--compute-ms`` alone, one
   thread a rank: ``OMP_NUM_THREADS=1``), never a sleep. Exchange time
   (``counters.exchange_seconds``) and consumer wait (``counters.wait_seconds``) as shares of
   the iteration's wall time, the slowest rank, one job a rep. Target: exchange <= 10% of batch
   time.
4. **Store RSS / raw bytes**: in a fresh process, VmRSS before and after constructing a
   preloaded ``DataStoreLoader`` over ``samples.h5``; (RSS increase) / (raw bytes stored).
   Target <= 1.1.

The ceiling printed with the results is the machine's memcpy bandwidth into a reused buffer
(``numpy.copyto`` of 256 MiB into an existing array, median of 5). GB/s are 10^9 bytes of ``x``
per second. Repetitions (``--reps``) alternate the order of the sides; every figure is the
median over the reps (for epochs >= 2: over every timed epoch of every rep) with its full
range ``[min-max]``, never the best case.

Usage::

    python benchmarks/loader.py                  # full run (several minutes on 2 cores)
    python benchmarks/loader.py --quick          # smoke run: N=48, 1 rep
    python benchmarks/loader.py --cases 1,4 --out /tmp/loader.md
    python benchmarks/loader.py --json benchmarks/results/loader.json   # for benchmarks/report.py
    python benchmarks/loader.py --workers 2,4,8 --memory-workers 0   # peer settings to try
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
from common import (
    PageCache,
    cores,
    key_ratio,
    machine_info,
    median,
    memcpy_ceiling,
    parse_counts,
    spread,
    stats,
    venv_tool,
    verdict,
    write_results,
)
from torch.utils.data import DataLoader, Dataset

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
XSHAPE = (4, 64, 64, 64)
YSHAPE = (4,)
XBYTES = int(np.prod(XSHAPE)) * 4
DEPTH = XSHAPE[1]
SLAB_CHUNKS = (1, 4, 8, 64, 64)
BATCH = 8
KS = (2, 4, 8)
RANKS = (2, 4)
LAYOUT_VERSION = 1
TARGETS = {"epoch1": 1.0, "cold": 5.0, "warm": 4.0}  # vs the disk peer
MEMORY_TARGET = 1.0  # epochs >= 2 vs the in-memory peer
PIN = torch.cuda.is_available()  # pin_memory where a GPU is used, as its users would
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
    p.add_argument(
        "--workers", default="auto", help="disk peer num_workers to try (default: cores, 2x)"
    )
    p.add_argument(
        "--memory-workers",
        default="auto",
        help="in-memory peer num_workers to try (default: 0 and the cores)",
    )
    p.add_argument("--cases", default="1,2,3,4", help="cases to run, comma separated")
    p.add_argument("--quick", action="store_true", help="smoke run: N=48, reps 1")
    p.add_argument("--warm", action="store_true", help="never drop the page cache")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the report here")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
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
    c = cores()
    args.workers = parse_counts(args.workers, sorted({c, 2 * c}), "--workers")
    args.memory_workers = parse_counts(args.memory_workers, [0, c], "--memory-workers")
    if not args.workers[0]:
        p.error("--workers: the disk peer needs worker processes (>= 1)")
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


# ----------------------------------------------------------------------------- the peers


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


class ArraySamples(Dataset):
    """Samples already in RAM: one tensor per field, indexed per ``__getitem__``."""

    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        self.tensors = {k: torch.from_numpy(a) for k, a in arrays.items()}
        self.n = len(next(iter(self.tensors.values())))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: t[i] for k, t in self.tensors.items()}


def read_all(paths: Paths, fmt: str) -> dict[str, np.ndarray]:
    """The whole dataset of format ``fmt`` in RAM: ``x`` and ``y`` arrays."""
    if fmt == "hdf5":
        with h5py.File(paths.h5, "r") as f:
            return {"x": f["x"][...], "y": f["y"][...]}
    return {"x": np.stack([np.load(p) for p in npy_files(paths.npy)]), "y": np.load(paths.labels)}


def peer_loader(ds: Dataset, workers: int) -> DataLoader:
    """A torch DataLoader over ``ds`` configured as its users run it."""
    return DataLoader(
        ds,
        batch_size=BATCH,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        persistent_workers=workers > 0,
        pin_memory=PIN,
    )


# ----------------------------------------------------------------------------- cache, timing


def consume(batches: Iterable[dict[str, torch.Tensor]]) -> int:
    """Iterate, touching one element of each batch; the number of samples delivered."""
    n = 0
    for batch in batches:
        x = batch["x"]
        float(x[0, 0, 0, 0, 0])
        n += x.shape[0]
    return n


# ----------------------------------------------------------------------------- case 1


PHASE_NAMES = ("epoch1", "cold", "warm", "construct")


@dataclass
class LoaderRuns:
    """Times of one format, every side: ``times[side][phase]`` lists of seconds. Sides:
    ``"ours"``, ``"disk/W"`` and ``"memory/W"`` (the peers with ``num_workers=W``)."""

    fmt: str
    sides: list[str]
    times: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.times = {s: {p: [] for p in PHASE_NAMES} for s in self.sides}

    def best(self, kind: str, phase: str) -> str:
        """The side of peer ``kind`` with the lowest median time in ``phase``."""
        mine = [s for s in self.sides if s.startswith(kind + "/")]
        return min(mine, key=lambda s: median(self.times[s][phase]))


def side_label(side: str) -> str:
    if side == "ours":
        return "DataStoreLoader"
    kind, w = side.split("/")
    return f"{'in-memory' if kind == 'memory' else 'disk'} DataLoader(num_workers={w})"


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
    want = n - n % BATCH  # every side: 8 per batch, a partial last batch dropped
    datasets: dict[str, tuple[Any, Callable[[], Dataset]]] = {
        "hdf5": (paths.h5, lambda: H5Samples(paths.h5)),
        "npy": (npy_spec(paths), lambda: NpySamples(paths.npy, paths.labels)),
    }
    torch.manual_seed(0)
    print(
        f"\n[1] loader vs torch DataLoader(batch_size={BATCH}, shuffle=True, drop_last=True, "
        f"persistent_workers=True, pin_memory={PIN}): disk num_workers {args.workers}, in "
        f"memory num_workers {args.memory_workers}; {n} samples, {args.epochs} epochs, "
        f"{args.reps} rep(s)",
        flush=True,
    )
    results = []
    for fmt, (ours_ds, disk_ds) in datasets.items():
        makers: dict[str, Callable[[], Iterable[dict[str, torch.Tensor]]]] = {
            "ours": lambda ds=ours_ds: DataStoreLoader(
                ds, batch_size=BATCH, seed=0, pin_memory=PIN
            ),
        }
        for w in args.workers:
            makers[f"disk/{w}"] = lambda w=w, disk_ds=disk_ds: peer_loader(disk_ds(), w)
        for w in args.memory_workers:
            makers[f"memory/{w}"] = lambda w=w, fmt=fmt: peer_loader(
                ArraySamples(read_all(paths, fmt)), w
            )
        runs = LoaderRuns(fmt, list(makers))
        for rep in range(args.reps):
            order = runs.sides if rep % 2 == 0 else runs.sides[::-1]
            for side in order:
                got = epochs_of(makers[side], args.epochs, cache, want, side)
                t = runs.times[side]
                for phase in ("epoch1", "construct"):
                    t[phase].append(got[phase])
                t["cold"].extend(got["cold"])
                t["warm"].extend(got["warm"])
                print(
                    f"  {fmt} rep {rep + 1}/{args.reps}: {side_label(side)}: epoch 1 "
                    f"{got['epoch1']:.2f} s (create {got['construct']:.2f}), cold "
                    f"{' '.join(f'{v:.3f}' for v in got['cold'])}, warm "
                    f"{' '.join(f'{v:.3f}' for v in got['warm'])}",
                    flush=True,
                )
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
    from datastore.maths.partition import Grid, full_region
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


def exchange_job(r: int, args: argparse.Namespace, paths: Paths) -> dict[str, Any]:
    """One ``exchange_job.py`` run on ``r`` ranks: its results, or ``{"error": ...}``."""
    job = os.path.join(HERE, "exchange_job.py")
    cmd = [
        venv_tool("mpiexec"), "-n", str(r), sys.executable, "-m", "mpi4py", job, paths.h5,
        "--batch", str(BATCH), "--epochs", "2", "--compute-ms", str(args.compute_ms),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one core of compute per rank
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, env.get("PYTHONPATH")]))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    except subprocess.TimeoutExpired:
        return {"error": "timed out after 600 s"}
    wall = time.perf_counter() - t0
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("EXCHANGE_JSON ")), None)
    if proc.returncode != 0 or line is None:
        err = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-8:]
        return {"error": f"exit {proc.returncode}: " + " | ".join(err)}
    res = json.loads(line.split(" ", 1)[1])
    res["wall_s"] = wall
    per = res["per_rank"]
    res["exchange_share"] = max(p["exchange_seconds"] / p["total_s"] for p in per)
    res["wait_share"] = max(p["wait_seconds"] / p["total_s"] for p in per)
    res["steps"] = per[0]["steps"]
    res["batch_ms"] = max(p["total_s"] for p in per) / max(1, res["steps"]) * 1e3
    res["compute_step_ms"] = max(p["compute_s"] for p in per) / max(1, res["steps"]) * 1e3
    res["bytes_per_step"] = statistics.mean(p["bytes_exchanged"] / max(1, p["steps"]) for p in per)
    res["mib_per_step"] = res["bytes_per_step"] / MIB
    res["exchange_ms"] = max(p["exchange_seconds"] for p in per) / max(1, res["steps"]) * 1e3
    last = [p["epochs"][-1] for p in per]  # steady state: buffers touched, ranks in step
    res["last_exchange_share"] = max(e["exchange_seconds"] / e["total_s"] for e in last)
    res["last_wait_share"] = max(e["wait_seconds"] / e["total_s"] for e in last)
    res["last_batch_ms"] = max(e["total_s"] / max(1, e["steps"]) for e in last) * 1e3
    return res


def run_case3(args: argparse.Namespace, paths: Paths) -> dict[int, list[dict[str, Any]]]:
    """``args.reps`` jobs for each rank count: ``{ranks: [one result a rep]}``."""
    print(
        f"\n[3] MPI exchange: global batch {BATCH} per rank, 2 epochs, compute "
        f"{args.compute_ms:g} ms per batch (CPU burnt, one thread a rank), {args.reps} rep(s)",
        flush=True,
    )
    results: dict[int, list[dict[str, Any]]] = {r: [] for r in RANKS}
    for rep in range(args.reps):
        for r in RANKS if rep % 2 == 0 else RANKS[::-1]:
            res = exchange_job(r, args, paths)
            results[r].append(res)
            if "error" in res:
                print(f"  rep {rep + 1} R={r}: FAILED: {res['error']}", flush=True)
                continue
            print(
                f"  rep {rep + 1} R={r}: {res['steps']} steps, batch {res['batch_ms']:.1f} ms "
                f"(compute {res['compute_step_ms']:.1f}), exchange {res['exchange_ms']:.1f} "
                f"ms/step ({res['exchange_share']:.1%}), wait {res['wait_share']:.1%}, "
                f"{res['bytes_per_step'] / MIB:.1f} MiB sent/step/rank, job wall "
                f"{res['wall_s']:.1f} s",
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
    loader = DataStoreLoader(path, batch_size=BATCH, seed=0)  # preloaded: the default
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
                "ring": loader.ring.nbytes,
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


def gbs(nbytes: float, secs: float) -> str:
    return f"{nbytes / secs / 1e9:.2f} GB/s" if secs > 0 else "-"


PHASES = {
    "epoch1": "epoch 1, cold (ours: creation + preload + epoch)",
    "cold": "epochs >= 2, cache dropped",
    "warm": "epochs >= 2, warm cache",
}
# (peer kind, phase, target) of every comparison of case 1, in the order reported
COMPARE = [("disk", phase, TARGETS[phase]) for phase in PHASES] + [
    ("memory", phase, MEMORY_TARGET) for phase in ("cold", "warm")
]


def timing(xs: list[float], payload: int, unit: float = 1.0, fmt: str = "{:.3f}") -> str:
    """``median [min-max]`` of seconds (scaled by ``unit``), with the median's GB/s."""
    m = median(xs)
    scaled = [x * unit for x in xs]
    rate = f", {gbs(payload, m)}" if payload else ""
    return f"{fmt.format(m * unit)} [{spread(scaled, fmt)}]{rate}"


def case1_rows(runs: LoaderRuns, payload: int) -> tuple[list[str], list[str]]:
    """Table rows and notes of case 1 for one format."""
    rows, t = [], runs.times
    for kind, phase, target in COMPARE:
        peer = runs.best(kind, phase)
        o, p = median(t["ours"][phase]), median(t[peer][phase])
        ratio = p / o
        rows.append(
            f"| 1 loader, {runs.fmt} | {PHASES[phase]}; vs {side_label(peer)} "
            f"| {timing(t['ours'][phase], payload)} | {timing(t[peer][phase], payload)} "
            f"| {ratio:.2f}x | >= {target:g}x | {verdict(ratio >= target)} |"
        )
    notes = [
        f"- 1 {runs.fmt}, every setting, median [range] s: "
        + "; ".join(
            f"{side_label(side)}: create {timing(t[side]['construct'], 0)}, epoch 1 "
            f"{timing(t[side]['epoch1'], 0)}, cold {timing(t[side]['cold'], 0)}, warm "
            f"{timing(t[side]['warm'], 0)}"
            for side in runs.sides
        )
    ]
    return rows, notes


def case3_rows(c3: dict[int, list[dict[str, Any]]]) -> tuple[list[str], list[str]]:
    """Table rows and notes of case 3: medians and ranges over the reps."""
    rows, notes = [], []
    for r, reps in c3.items():
        ok = [res for res in reps if "error" not in res]
        notes += [f"- 3 R={r}: {res['error']}" for res in reps if "error" in res]
        if not ok:
            rows.append(
                f"| 3 MPI exchange | R={r} | error | - | - | <= {EXCHANGE_TARGET:.0%} | MISS |"
            )
            continue

        def stat(key: str, fmt: str = "{:.1f}", ok: list = ok) -> str:
            xs = [res[key] for res in ok]
            return f"{fmt.format(median(xs))} [{spread(xs, fmt)}]"

        shares = [res["exchange_share"] for res in ok]
        share = median(shares)
        rows.append(
            f"| 3 MPI exchange | R={r}, exchange share of batch time (slowest rank) "
            f"| {share:.1%} [{spread(shares, '{:.1%}')}] ({stat('exchange_ms')} ms/step) "
            f"| batch {stat('batch_ms')} ms | {share:.3f} | <= {EXCHANGE_TARGET:.0%} "
            f"| {verdict(share <= EXCHANGE_TARGET)} |"
        )
        expect = BATCH * (XBYTES + 16) * (r - 1) / r
        res = ok[0]
        notes.append(
            f"- 3 R={r}, medians [ranges] over {len(ok)} job(s): {res['steps']} steps, compute "
            f"{res['compute_ms']:g} ms/step calibrated alone, {stat('compute_step_ms')} ms/step "
            f"as run; consumer wait {stat('wait_share', '{:.1%}')} of batch time (slowest "
            f"rank), sent {stat('mib_per_step', '{:.2f}')} MiB/step/rank (a uniform owner "
            f"split predicts {expect / MIB:.2f}), job wall {stat('wall_s')} s; last epoch "
            f"alone: exchange {stat('last_exchange_share', '{:.1%}')}, wait "
            f"{stat('last_wait_share', '{:.1%}')}, batch {stat('last_batch_ms')} ms"
            + ("; oversubscribed: more ranks than cores" if r > cores() else "")
        )
    return rows, notes


def report(
    args: argparse.Namespace,
    ceiling: float,
    cache: PageCache,
    c1: list[LoaderRuns],
    c2: list[BlockRuns],
    c3: dict[int, list[dict[str, Any]]],
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
        r, nt = case1_rows(runs, payload)
        rows += r
        notes += nt
    h = args.halo
    for runs in c2:
        full = median(runs.full)
        for k in KS:
            b = median(runs.block[k])
            bound = BLOCK_SLACK * (1 / k + 2 * h / DEPTH)
            rows.append(
                f"| 2 block read, {runs.fmt} | block 0 of k={k}, halo {h} "
                f"| {timing(runs.block[k], 0, 1e3, '{:.1f}')} ms "
                f"| full {timing(runs.full, 0, 1e3, '{:.1f}')} ms | {b / full:.3f} "
                f"| <= {bound:.3f} x full | {verdict(b <= bound * full)} |"
            )
        notes.append(
            f"- 2 {runs.fmt} ({runs.note}): full samples {gbs(n * XBYTES, full)}; "
            + ", ".join(f"k={k} block {median(runs.block[k]) / full:.3f} of full" for k in KS)
        )
    r, nt = case3_rows(c3)
    rows += r
    notes += nt
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
                "ratio: case 1 = peer time / ours time (> 1: we are faster), of medians; case 2 "
                "= block time / full time; cases 3, 4 = the figure itself. Figures: median "
                "[full range] over the reps (epochs >= 2: over every timed epoch of every rep). "
                "Case 1 compares the peer's fastest setting for each phase.",
                *notes,
                "",
                f"- ceiling: memcpy into a reused buffer (numpy.copyto, 256 MiB, median of 5): "
                f"{ceiling:.2f} GB/s",
                f"- data: {n} samples x {XBYTES / MIB:.0f} MiB (x float32 {XSHAPE}, y float32 "
                f"{YSHAPE}); GB/s count x only; batch {BATCH}; epochs {args.epochs}; reps "
                f"{args.reps}; work dir {work}",
                f"- peers: torch DataLoader(batch_size={BATCH}, shuffle=True, drop_last=True, "
                f"persistent_workers=True when num_workers > 0, pin_memory={PIN}), default "
                f"collate; disk num_workers {args.workers}, in-memory num_workers "
                f"{args.memory_workers}; the npy peers also deliver labels, ours x only for npy",
                f"- page cache: {cache.note}",
                "- machine: "
                + machine_info(f"torch {torch.__version__}", f"h5py {h5py.__version__}"),
            ]
        )
        + "\n"
    )


KEY_COMPARE = (("disk", "epoch1"), ("disk", "warm"), ("memory", "warm"))  # in the summary


def as_json(
    args: argparse.Namespace,
    ceiling: float,
    cache: PageCache,
    c1: list[LoaderRuns],
    c2: list[BlockRuns],
    c3: dict[int, list[dict[str, Any]]],
    c4: dict[str, Any] | None,
    work: str,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The results of every case (seconds of every side and phase with their ranges, the
    comparisons, block fractions, exchange shares, RSS) and the key ratios."""
    n, h = args.samples, args.halo
    payload = (n - n % BATCH) * XBYTES
    results: dict[str, Any] = {
        "samples": n,
        "sample_bytes": XBYTES,
        "epoch_bytes": payload,
        "batch": BATCH,
        "epochs": args.epochs,
        "reps": args.reps,
        "halo": h,
        "depth": DEPTH,
        "memcpy_gbps": ceiling,
        "page_cache": cache.note,
        "work_dir": work,
        "loader": [],
        "blocks": [],
        "exchange": {},
        "rss": c4,
    }
    ratios = []
    for runs in c1:
        compare = []
        for kind, phase, target in COMPARE:
            peer = runs.best(kind, phase)
            o, p = median(runs.times["ours"][phase]), median(runs.times[peer][phase])
            compare.append(
                {
                    "kind": kind,
                    "phase": phase,
                    "measure": PHASES[phase],
                    "peer": peer,
                    "peer_label": side_label(peer),
                    "ratio": p / o,
                    "target": target,
                    "pass": p / o >= target,
                }
            )
            if (kind, phase) in KEY_COMPARE:
                ratios.append(
                    key_ratio(
                        f"{runs.fmt}, {PHASES[phase]}: vs {side_label(peer)}",
                        ours=payload / o / 1e9,
                        peer=payload / p / 1e9,
                        unit="GB/s",
                        ratio=p / o,
                        of="peer time / ours",
                        target=f">= {target:g}x",
                        ok=p / o >= target,
                    )
                )
        results["loader"].append(
            {
                "format": runs.fmt,
                "seconds": {
                    side: {phase: stats(t[phase]) for phase in PHASE_NAMES}
                    for side, t in runs.times.items()
                },
                "labels": {side: side_label(side) for side in runs.sides},
                "compare": compare,
            }
        )
    for runs in c2:
        full = median(runs.full)
        blocks = {}
        for k in KS:
            b = median(runs.block[k])
            bound = BLOCK_SLACK * (1 / k + 2 * h / DEPTH)
            blocks[str(k)] = {
                "seconds": stats(runs.block[k]),
                "fraction": b / full,
                "bound": bound,
                "pass": b <= bound * full,
            }
        results["blocks"].append(
            {"format": runs.fmt, "note": runs.note, "full_seconds": stats(runs.full), "k": blocks}
        )
        kmax = blocks[str(max(KS))]
        ratios.append(
            key_ratio(
                f"{runs.fmt}: block 0 of k={max(KS)} (+halo {h}) vs the full sample",
                ours=median(runs.block[max(KS)]) * 1e3,
                peer=full * 1e3,
                unit="ms",
                ratio=kmax["fraction"],
                of="block time / full",
                target=f"<= {kmax['bound']:.3f}",
                ok=kmax["pass"],
            )
        )
    for r, reps in c3.items():
        ok = [res for res in reps if "error" not in res]
        results["exchange"][str(r)] = {
            key: stats([res[key] for res in ok])
            for key in ("exchange_share", "wait_share", "batch_ms", "exchange_ms", "mib_per_step")
        } | {"target": EXCHANGE_TARGET, "errors": [res["error"] for res in reps if "error" in res]}
    return results, ratios


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
    c3 = run_case3(args, paths) if "3" in args.cases else {}
    c4 = run_case4(paths) if "4" in args.cases else None
    text = report(args, ceiling, cache, c1, c2, c3, c4, work)
    print("\n" + text, end="")
    print(f"(benchmark wall time {time.perf_counter() - t_start:.0f} s)")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.json:
        write_results(
            args.json, "loader", *as_json(args, ceiling, cache, c1, c2, c3, c4, work),
            f"torch {torch.__version__}", f"h5py {h5py.__version__}",
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
