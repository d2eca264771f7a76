"""How one rank's per-epoch planning cost grows with the dataset and the ranks.

What is measured (one process; ranks simulated: only rank 0's share is computed)
----------------------------------------------------------------------------------
For N samples (``--samples``, default 10^6, 10^7, 10^8) and P data ranks (``--ranks``, default
64, 512, 4096), global batch ``B = 4 P``, each rank owning a contiguous 1/P:

- **epoch plan**: rank 0's samples for every step of an epoch, ``Schedule.rank_epoch`` (the
  keyed bijection evaluated at its positions only, O(N/P)). Before (the peer): ``argsort`` of
  N PCG64 keys, then rank 0's slices (O(N log N), O(N) memory); skipped above ``--old-max``.
- **exchange plan**: rank 0's messages (what it receives and sends) for every step of an
  epoch: ``EpochPlan`` (its samples' positions by the inverse of the order, the epoch's
  messages sorted with array operations, O(N/P)), then each step's ``messages(step)`` (a view
  of them). "as objects": the same with every step's messages read as ``Message`` objects,
  as the exchanges read them. Before: ``rank_plan`` of each step's whole global batch (O(N)
  per epoch); skipped above ``--old-max``.
- **plan**: epoch plan + exchange plan, one after the other (what a rank computes per epoch);
  the target: under 0.1 s and 64 MiB at 10^8 x 4,096 and at 10^9 x 65,536.

What the plan leaves out, counted in a second table:

- **index lookups**: the sender looks up the store's slot of every sample it sends
  (``Store.lasting`` -> ``KeyIndex.find``), one call per sample sent in the epoch. For a
  contiguous share the index is arithmetic (0 bytes); for a shard layout (files of
  ``--file-samples`` samples dealt round-robin to the ranks: rank 0's keys are runs) it keeps
  16 B per key and each lookup is a binary search.
- **owner runs**: every rank of a shard layout keeps the owners as runs (16 B per run: one
  run per file here), and the exchange plan with those owners (a binary search over them).

Time: ``time.perf_counter`` around one call, untraced, median and range of ``--reps``;
memory: the ``tracemalloc`` peak of one more call, traced apart (tracing multiplies the time
of code that makes many small objects, so the two are never measured together).

Usage::

    python benchmarks/scale.py                              # about a minute on 2 cores
    python benchmarks/scale.py --samples 1e8 1e9 --ranks 4096 65536 --reps 5
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
from common import machine_info, spread

from datastore.maths.exchange import EpochPlan, rank_plan
from datastore.maths.order import Schedule, rank_layout
from datastore.maths.ownership import RangeOwners, RunOwners
from datastore.store.keyindex import KeyIndex

MIB = 1 << 20
TARGETS = ((10**8, 4096), (10**9, 65536))  # (N, P) where the plan must stay under the bounds
TARGET_S, TARGET_MIB = 0.1, 64
EPOCH = 3


def timed(fn: Callable[[], Any], reps: int) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn()``, untraced."""
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def peak_mib(fn: Callable[[], Any]) -> float:
    """The ``tracemalloc`` peak of one call of ``fn()``, in MiB."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / MIB
    finally:
        tracemalloc.stop()


def cell(times: list[float]) -> str:
    """``median (min-max)`` of ``times``, in seconds."""
    return f"{statistics.median(times):.4f} ({spread(times, '{:.4f}')})"


def old_plan(n: int, gb: int, ranks: int, seed: int, epoch: int) -> np.ndarray:
    """What every rank computed before: the whole sorted-keys order, then its slices."""
    bits = np.random.PCG64(np.random.SeedSequence([seed, epoch]))
    order = np.argsort(bits.random_raw(n), kind="stable")
    b = gb // ranks
    steps = n // gb
    return order[: steps * gb].reshape(steps, gb)[:, :b].copy()


def exchange_plan(sched: Schedule, owner: RunOwners, ranks: int, objects: bool = False) -> int:
    """Rank 0's messages for every step of an epoch (:class:`EpochPlan`): how many (read as
    ``Message`` objects when ``objects``)."""
    ep = EpochPlan(sched, owner, rank_layout(0, ranks), EPOCH, owner.keys_of(0))
    if objects:
        return sum(len(list(ep.messages(s))) for s in range(sched.steps_per_epoch))
    return sum(len(ep.messages(s)) for s in range(sched.steps_per_epoch))


def old_exchange_plan(sched: Schedule, ranks: int) -> int:
    """The same from each step's whole global batch (``rank_plan``), as before."""
    owner = RangeOwners(sched.num_samples, ranks)
    return sum(
        len(rank_plan(sched.global_batch_at(EPOCH, s), owner, ranks, 1, 0))
        for s in range(sched.steps_per_epoch)
    )


def shard_owners(n: int, ranks: int, file_samples: int) -> RunOwners:
    """A shard layout's owners: files of ``file_samples`` samples dealt round-robin to ranks."""
    starts = np.arange(0, n, file_samples, dtype=np.int64)
    return RunOwners(starts, np.arange(len(starts), dtype=np.int64) % ranks, n)


def lookups(index: KeyIndex, samples: np.ndarray) -> int:
    """The store's slot of each sample, one ``find`` each, as the sender looks them up."""
    find = index.find
    return sum(find(k) for k in samples.tolist())


def plan_row(n: int, ranks: int, a: argparse.Namespace) -> tuple[str, float, float]:
    """The plan table's row for ``(n, ranks)``, its plan's median seconds and peak MiB."""
    sched = Schedule(n, 4 * ranks, seed=1)
    owner = RangeOwners(n, ranks)
    epoch_fn = lambda: sched.rank_epoch(EPOCH, 0, ranks)  # noqa: E731
    ex_fn = lambda: exchange_plan(sched, owner, ranks)  # noqa: E731
    both = lambda: (epoch_fn(), ex_fn())  # noqa: E731
    ep_t, ex_t, both_t = timed(epoch_fn, a.reps), timed(ex_fn, a.reps), timed(both, a.reps)
    obj_t = timed(lambda: exchange_plan(sched, owner, ranks, objects=True), a.reps)
    ep_m, ex_m, both_m = peak_mib(epoch_fn), peak_mib(ex_fn), peak_mib(both)
    old = old_ex = "skipped"
    if n <= a.old_max:
        old = cell(timed(lambda: old_plan(n, 4 * ranks, ranks, 1, EPOCH), a.reps))
        old_ex = cell(timed(lambda: old_exchange_plan(sched, ranks), 1))
    row = (f"| {n:.0e} | {ranks} | {sched.steps_per_epoch} | {cell(ep_t)} | {ep_m:.1f} | "
           f"{cell(ex_t)} | {ex_m:.1f} | {cell(obj_t)} | **{cell(both_t)}** | **{both_m:.1f}** | "
           f"{old} | {old_ex} | {os.getloadavg()[0]:.1f} |")  # fmt: skip
    return row, statistics.median(both_t), both_m


def left_out_row(n: int, ranks: int, a: argparse.Namespace) -> str:
    """The second table's row: index lookups and a shard layout's bytes, for ``(n, ranks)``."""
    sched = Schedule(n, 4 * ranks, seed=1)
    ranges = RangeOwners(n, ranks)
    _, sent = sched.positions_of(EPOCH, ranges.keys_of(0))  # one lookup per sample sent
    contiguous = KeyIndex(ranges.keys_of(0))
    shards = shard_owners(n, ranks, a.file_samples)
    keys = shards.keys_of(0)
    index = KeyIndex(keys)
    _, sent_shard = sched.positions_of(EPOCH, keys)
    runs_mib = (shards.starts.nbytes + shards.ranks.nbytes) / MIB
    ex_t = timed(lambda: exchange_plan(sched, shards, ranks), a.reps)
    return (f"| {n:.0e} | {ranks} | {len(sent)} | "
            f"{cell(timed(lambda: lookups(contiguous, sent), a.reps))} | "
            f"{contiguous.nbytes / MIB:.2f} | "
            f"{cell(timed(lambda: lookups(index, sent_shard), a.reps))} | "
            f"{index.nbytes / MIB:.2f} ({index.nbytes / max(1, len(keys)):.0f} B/key) | "
            f"{len(shards.starts)} runs, {runs_mib:.2f} | {cell(ex_t)} | "
            f"{os.getloadavg()[0]:.1f} |")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # fmt: off
    p.add_argument("--samples", type=float, nargs="+", default=[1e6, 1e7, 1e8],
                   help="dataset sizes N (default: 1e6 1e7 1e8)")
    p.add_argument("--ranks", type=int, nargs="+", default=[64, 512, 4096],
                   help="data ranks P, simulated (default: 64 512 4096)")
    p.add_argument("--old-max", type=float, default=1e7,
                   help="the peer (the plans before) only up to this N (default: 1e7)")
    p.add_argument("--reps", type=int, default=3, help="timed calls per cell (default: 3)")
    p.add_argument("--file-samples", type=int, default=1000,
                   help="samples per file of the shard layout (default: 1000)")
    # fmt: on
    a = p.parse_args()
    if min(a.samples) < 1 or min(a.ranks) < 1 or a.reps < 1 or a.file_samples < 1:
        p.error("--samples, --ranks, --reps, --file-samples: each >= 1")
    print(machine_info(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"))
    print(f"\nPer rank per epoch, seconds: median (range) of {a.reps}; MiB: tracemalloc peak.\n")
    print(
        "| N | P | steps | epoch plan s | MiB | exchange plan s | MiB | as objects s | "
        "**plan s** | **MiB** | epoch plan before s | exchange plan before s | load |"
    )
    print("|---:|---:|---:|---|---:|---|---:|---|---|---:|---|---|---:|")
    largest_p: dict[int, float] = {}
    met = []
    for n in (int(x) for x in a.samples):
        for ranks in a.ranks:
            row, seconds, mib = plan_row(n, ranks, a)
            print(row, flush=True)
            if ranks == max(a.ranks):
                largest_p[n] = seconds
            if (n, ranks) in TARGETS:
                met.append((n, ranks, seconds, mib))
    print(f"\nLeft out of the plan (files of {a.file_samples} samples for the shard layout):\n")
    print(
        "| N | P | lookups | contiguous: lookups s | index MiB | shard layout: lookups s | "
        "index MiB | owner runs MiB | exchange plan s | load |"
    )
    print("|---:|---:|---:|---|---:|---|---|---|---|---:|")
    for n in (int(x) for x in a.samples):
        for ranks in a.ranks:
            print(left_out_row(n, ranks, a), flush=True)
    if len(largest_p) > 1:
        xs = [math.log(n) for n in largest_p]
        ys = [math.log(t) for t in largest_p.values()]
        slope = np.polyfit(xs, ys, 1)[0]
        print(f"\ngrowth of the plan's time in N at P = {max(a.ranks)}: N^{slope:.2f}")
    for n, ranks, seconds, mib in met:
        ok = seconds < TARGET_S and mib < TARGET_MIB
        print(f"N = {n:.0e}, P = {ranks}, epoch plan + exchange plan: {seconds:.4f} s, "
              f"{mib:.1f} MiB (target < {TARGET_S} s, < {TARGET_MIB} MiB): "
              f"{'met' if ok else 'MISSED'}")  # fmt: skip


if __name__ == "__main__":
    main()
