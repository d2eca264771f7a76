"""What each shuffle costs in exchange traffic and gives in mixing.

The worst case for a local shuffle, and a common one in science: the dataset is stored class
by class (sample ``i`` has label ``i * C // N``, e.g. one simulation parameter after another).
The peer is ``shuffle="global"`` (every rank's batch drawn from the whole dataset); ratios are
against it.

1. **Simulated** (one process, no data): ``N`` samples, ``P`` data ranks each owning a
   contiguous ``1/P`` (the embedded exchange's owners), ``b`` samples per rank per step. For
   every rank and each shuffle: the share of its samples owned by another rank (what the
   exchange moves, as a fraction of the dataset per epoch) and the mixing of its batches.
2. **Real** (``mpiexec -n R python -m mpi4py benchmarks/shuffle_job.py``): an HDF5 dataset
   written the same way; the bytes each rank sent per epoch (the loader's counter), the epoch
   time (median of the epochs after the first) and the same mixing figures from the batches
   actually delivered.

Mixing: **pairs** is the share of same-label pairs of samples within a batch, divided by what
random batches give (``1/C``): 1 is mixed, ``C`` is batches of one class. **classes** is the
share of the ``C`` classes a rank sees in an epoch.

Usage::

    python benchmarks/shuffle.py                   # about a minute on 2 cores
    python benchmarks/shuffle.py --samples 100000 --ranks 16 --real-ranks 2
    python benchmarks/shuffle.py --json benchmarks/results/shuffle.json  # for benchmarks/report.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import h5py
import numpy as np
from common import key_ratio, machine_info, spread, stats, venv_tool, write_results

from datastore.maths.order import Schedule
from datastore.maths.ownership import Homes, RangeOwners

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=1_000_000, help="N of the simulated part")
    p.add_argument("--ranks", type=int, default=64, help="data ranks of the simulated part")
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--shuffles", default="global,shard,window:4096,window:256,none")
    p.add_argument("--real-ranks", type=int, default=4, help="0: skip the MPI part")
    p.add_argument("--real-samples", type=int, default=2048)
    p.add_argument("--real-kib", type=int, default=32, help="KiB per sample of the MPI part")
    p.add_argument("--real-shuffles", default="global,shard,window:64,none")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    return p.parse_args(argv)


def pairs(labels: np.ndarray, classes: int) -> float:
    """Same-label pairs within each batch (rows), over what random batches give."""
    b = labels.shape[1]
    same = 0
    for row in labels:
        n = np.bincount(row, minlength=classes)
        same += int((n * (n - 1)).sum())
    return same / (len(labels) * b * (b - 1)) * classes


def simulated(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    n, p, b, c = args.samples, args.ranks, args.batch, args.classes
    owner = RangeOwners(n, p)
    out = {}
    for shuffle in args.shuffles.split(","):
        local = shuffle == "shard" or shuffle.startswith("window")
        homes = Homes(owner, p) if local else None
        sched = Schedule(n, p * b, seed=1, shuffle=shuffle, homes=homes)
        moved, pair, seen, plan_s = 0, [], [], []
        for d in range(p):
            t0 = time.perf_counter()
            mine = sched.rank_epoch(0, d, p)
            plan_s.append(time.perf_counter() - t0)
            moved += int((owner[mine.ravel()] != d).sum())
            labels = mine * c // n
            pair.append(pairs(labels, c))
            seen.append(len(np.unique(labels)) / c)
        out[shuffle] = {
            "moved": moved / (sched.steps_per_epoch * p * b),
            "pairs": statistics.mean(pair),
            "classes": statistics.mean(seen),
            "plan_ms": statistics.median(plan_s) * 1e3,
        }
    return out


def write_dataset(path: str, n: int, kib: int, classes: int) -> None:
    per = kib * 1024 // 4
    with h5py.File(path, "w") as f:
        x = f.create_dataset("x", (n, per), dtype="float32")
        for s in range(0, n, 256):
            e = min(n, s + 256)
            x[s:e] = np.arange(s, e, dtype=np.float32)[:, None]
        f["label"] = (np.arange(n) * classes // n).astype(np.int64)


def real(args: argparse.Namespace, folder: str) -> dict[str, dict[str, Any]]:
    path = os.path.join(folder, "sorted.h5")
    write_dataset(path, args.real_samples, args.real_kib, args.classes)
    cmd = [
        venv_tool("mpiexec"), "-n", str(args.real_ranks), sys.executable, "-m", "mpi4py",
        os.path.join(HERE, "shuffle_job.py"), path, "--shuffles", args.real_shuffles,
        "--batch", str(args.batch), "--epochs", str(args.epochs),
    ]  # fmt: skip
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=600)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("SHUFFLE_JSON ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"shuffle_job.py failed (exit {proc.returncode})")
    got = json.loads(lines[0].split(" ", 1)[1])
    out = {}
    for shuffle, res in got.items():
        ranks = res["ranks"]
        later = [s for r in ranks for s in r["seconds"][1:]] or [ranks[0]["seconds"][0]]
        labels = [np.asarray(r["labels"][-1]) for r in ranks]
        out[shuffle] = {
            "sent_mib": statistics.mean(r["sent"][-1] for r in ranks) / 2**20,
            "epoch_s": statistics.median(later),
            "epoch_range": spread(later, "{:.3f}"),
            "epoch_seconds": stats(later),
            "pairs": statistics.mean(pairs(lab, args.classes) for lab in labels),
            "classes": statistics.mean(len(np.unique(lab)) / args.classes for lab in labels),
        }
    return out


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else ("1.00x" if a == 0 else "inf")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(machine_info())
    print(
        f"\n1. simulated: N={args.samples:,} P={args.ranks} b={args.batch} C={args.classes}, "
        "labels stored class by class; ratios against global"
    )
    sim = simulated(args)
    g = sim.get("global")
    print(f"{'shuffle':<14}{'moved':>8}{'pairs':>9}{'classes':>9}{'plan ms':>9}")
    for s, r in sim.items():
        print(
            f"{s:<14}{r['moved']:>8.3f}{r['pairs']:>9.2f}{r['classes']:>9.2f}"
            f"{r['plan_ms']:>9.2f}" + (f"   pairs {ratio(r['pairs'], g['pairs'])}" if g else "")
        )
    res: dict[str, dict[str, Any]] = {}
    if args.real_ranks:
        print(
            f"\n2. mpiexec -n {args.real_ranks}: {args.real_samples} samples of "
            f"{args.real_kib} KiB, b={args.batch}, {args.epochs} epochs"
        )
        with tempfile.TemporaryDirectory() as folder:
            res = real(args, folder)
        g = res.get("global")
        print(
            f"{'shuffle':<14}{'sent MiB':>10}{'epoch s':>9}  {'range':<16}{'pairs':>7}"
            f"{'classes':>9}  vs global: sent, time"
        )
        for s, r in res.items():
            vs = f"  {ratio(r['sent_mib'], g['sent_mib'])}, {ratio(r['epoch_s'], g['epoch_s'])}"
            print(
                f"{s:<14}{r['sent_mib']:>10.2f}{r['epoch_s']:>9.3f}  {r['epoch_range']:<16}"
                f"{r['pairs']:>7.2f}{r['classes']:>9.2f}" + (vs if g else "")
            )
    if args.json:
        write_results(args.json, "shuffle", *as_json(args, sim, res))
    return 0


def as_json(
    args: argparse.Namespace, sim: dict[str, dict[str, float]], real: dict[str, dict[str, Any]]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The results of both parts and the key ratios: each other shuffle's epoch time on the
    MPI ranks against ``"global"``'s. Shuffles that send nothing (``"shard"``, ``"window:K"``)
    cost about the same time: they differ in their mixing (pairs) and what they send."""
    settings = {k: v for k, v in vars(args).items() if k != "json"}
    ratios = []
    g = real.get("global")
    for s, r in real.items():
        if g and s != "global":
            ratios.append(
                key_ratio(
                    f"shuffle={s!r} vs 'global', epoch on {args.real_ranks} MPI ranks "
                    f"(sent {r['sent_mib']:.1f} vs {g['sent_mib']:.1f} MiB per rank; "
                    f"pairs {r['pairs']:.2f} vs {g['pairs']:.2f})",
                    ours=r["epoch_s"],
                    peer=g["epoch_s"],
                    unit="s",
                    ratio=g["epoch_s"] / r["epoch_s"],
                    of="peer time / ours",
                )
            )
    return {"settings": settings, "simulated": sim, "real": real}, ratios


if __name__ == "__main__":
    raise SystemExit(main())
