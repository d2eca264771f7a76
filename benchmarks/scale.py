"""How one rank's per-epoch cost grows with the dataset: the epoch plan and the store's index.

What is measured (one process; ranks simulated: only rank 0's share is computed)
----------------------------------------------------------------------------------
For N samples (``--samples``, default 10^6, 10^7, 10^8) and P data ranks (``--ranks``, default
64, 512, 4096), global batch ``B = 4 P``:

- **epoch plan**: rank 0's samples for every step of an epoch. Ours:
  ``Schedule.rank_epoch`` (the keyed bijection, O(N/P)). Before (the peer): the order every rank
  used to compute, ``argsort`` of N PCG64 keys, then rank 0's slices (O(N log N), O(N) memory);
  skipped above ``--old-max`` samples (default 10^7: 2 GiB and ~30 s at 10^8 by extrapolation).
- **index**: the slots of rank 0's samples. Ours: the bytes ``KeyIndex`` keeps for its
  contiguous share (the embedded loader's owners are contiguous ranges): none. Before: the
  ``tracemalloc`` peak of a dict of its keys (up to 2 million keys).

- **exchange plan**: rank 0's messages (what it receives and sends) for every step of an
  epoch, each rank owning a contiguous 1/P. Ours: ``EpochPlan`` (the positions of its own
  samples, once per epoch, by the inverse of the order; O(N/P)). Before: ``rank_plan`` of each
  step's whole global batch (O(B) per step, O(N) per epoch); skipped above ``--old-max``.
  One repetition each.

Time: ``time.perf_counter`` around one call (median of ``--reps``); memory: the peak of
``tracemalloc`` during it (Python and NumPy allocations). Printed: a table, the fitted growth
exponent of our plan's time in N at the largest P (slope of log time vs log N), and the target
check: at N = 10^8, P = 4,096 under 1 s and under 256 MiB.

Usage::

    python benchmarks/scale.py                                  # about a minute on 2 cores
    python benchmarks/scale.py --samples 1e6 1e7 --ranks 64
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
from common import machine_info

from datastore.exchange import EpochPlan, rank_plan
from datastore.keyindex import KeyIndex
from datastore.order import Schedule, rank_layout
from datastore.ownership import RangeOwners, contiguous_owners

MIB = 1 << 20


def measured(fn: Callable[[], Any], reps: int) -> tuple[float, float]:
    """``(median seconds, peak MiB)`` of ``fn()``."""
    times, peaks = [], []
    for _ in range(reps):
        tracemalloc.start()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        peaks.append(tracemalloc.get_traced_memory()[1] / MIB)
        tracemalloc.stop()
    return statistics.median(times), max(peaks)


def old_plan(n: int, gb: int, ranks: int, seed: int, epoch: int) -> np.ndarray:
    """What every rank computed before: the whole sorted-keys order, then its slices."""
    bits = np.random.PCG64(np.random.SeedSequence([seed, epoch]))
    order = np.argsort(bits.random_raw(n), kind="stable")
    b = gb // ranks
    steps = n // gb
    return order[: steps * gb].reshape(steps, gb)[:, :b].copy()


def exchange_plan(sched: Schedule, ranks: int) -> int:
    """Rank 0's messages for every step of an epoch (:class:`EpochPlan`): how many."""
    owner = RangeOwners(sched.num_samples, ranks)
    ep = EpochPlan(sched, owner, rank_layout(0, ranks), 3, owner.keys_of(0))
    return sum(len(ep.messages(s)) for s in range(sched.steps_per_epoch))


def old_exchange_plan(sched: Schedule, ranks: int) -> int:
    """The same from each step's whole global batch (``rank_plan``), as before."""
    owner = RangeOwners(sched.num_samples, ranks)
    return sum(
        len(rank_plan(sched.global_batch_at(3, s), owner, ranks, 1, 0))
        for s in range(sched.steps_per_epoch)
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=float, nargs="+", default=[1e6, 1e7, 1e8])
    p.add_argument("--ranks", type=int, nargs="+", default=[64, 512, 4096])
    p.add_argument("--old-max", type=float, default=1e7)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    print(machine_info())
    print("\n| N | P | plan (ours) s | plan MiB | plan (before) s | before MiB | "
          "index kept (ours) MiB | index (dict) MiB | exchange plan (ours) s | MiB | "
          "exchange plan (before) s |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    largest_p: dict[int, float] = {}
    target = None
    for n in (int(x) for x in a.samples):
        for ranks in a.ranks:
            gb = 4 * ranks
            sched = Schedule(n, gb, seed=1)
            ours_s, ours_mib = measured(lambda: sched.rank_epoch(3, 0, ranks), a.reps)  # noqa: B023
            old = "skipped"
            old_mib = ""
            if n <= a.old_max:
                s, m = measured(lambda: old_plan(n, gb, ranks, 1, 3), a.reps)  # noqa: B023
                old, old_mib = f"{s:.3f}", f"{m:.0f}"
            share = np.flatnonzero(contiguous_owners(n, ranks) == 0) if n <= 1e7 else None
            index_mib = KeyIndex(np.arange(-(-n // ranks))).nbytes / MIB  # rank 0's share, kept
            dict_mib = ""
            if share is not None and len(share) <= 2_000_000:
                _, m = measured(lambda: {int(k): i for i, k in enumerate(share)}, 1)  # noqa: B023
                dict_mib = f"{m:.1f}"
            ex_s, ex_mib = measured(lambda: exchange_plan(sched, ranks), 1)  # noqa: B023
            ex_old = "skipped"
            if n <= a.old_max:
                ex_old = f"{measured(lambda: old_exchange_plan(sched, ranks), 1)[0]:.2f}"  # noqa: B023
            row = f"| {n:.0e} | {ranks} | {ours_s:.4f} | {ours_mib:.1f} | {old} | {old_mib} | "
            print(row + f"{index_mib:.2f} | {dict_mib} | {ex_s:.3f} | {ex_mib:.1f} | {ex_old} |")
            if ranks == max(a.ranks):
                largest_p[n] = ours_s
            if n == 10**8 and ranks == 4096:
                target = (ours_s + ex_s, max(ours_mib, ex_mib))
    if len(largest_p) > 1:
        xs = [math.log(n) for n in largest_p]
        ys = [math.log(t) for t in largest_p.values()]
        slope = np.polyfit(xs, ys, 1)[0]
        print(f"\ngrowth of our plan's time in N at P = {max(a.ranks)}: N^{slope:.2f}")
    if target is not None:
        ok = target[0] < 1 and target[1] < 256
        print(f"N = 1e8, P = 4096, epoch plan + exchange plan: {target[0]:.3f} s, "
              f"{target[1]:.1f} MiB "
              f"(target < 1 s, < 256 MiB): {'met' if ok else 'MISSED'}")  # fmt: skip


if __name__ == "__main__":
    main()
