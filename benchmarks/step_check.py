"""The loader's per-step check at scale: real runs at a few ranks, a simulation at 65,536.

What is measured
----------------
Every step of an exchange the ranks check whether any consumer stopped
(``datastore.ranks.agree.StepSync.halt``). Before: :meth:`Collective.allgather_ints`, a message
to and from every other rank, 2 (P - 1) per rank. Now: one ``Iallreduce`` of 6 int64
(:meth:`Collective.allreduce_max`), which MPICH runs as recursive doubling for a few bytes:
``r(P) = log2 p`` rounds for the largest power of two ``p <= P``, plus 2 when ``P > p`` (the
ranks beyond ``p`` fold in first and are told last), one message out and one in a round.

1. **Real runs** (``--real``, default 1 2 3 4): ``mpiexec -n P python -m mpi4py`` this file
   ``--job``: after a warm-up, ``--checks`` checks of each kind back to back; the seconds per
   check, the mean over ranks (the median of ``--reps`` runs, and their range).
2. **The model**: a simulation that plays each rank's clock through the messages: the old
   check costs ``a + L + m (P - 1)`` (``m``: posting and testing a message to and one from a
   peer; ``L``: the wait for the messages), the new one ``c + g r(P)`` (a round: a message
   each way and the wait for the partner), rounds played rank by rank with the partner of
   each round (``i xor 2^k``) and the fold-in. ``a`` and ``c`` are the checks' cost on 1 rank
   (no message), ``m`` is timed on 1 rank (messages to itself), ``L`` and ``g`` come from the
   2-rank run: the runs where each rank has a core of its own, as on a cluster. The
   prediction for every real run and its error are printed; 3 and 4 ranks (and 8 when
   asked) are the model's check.
3. **At scale** (``--simulate``, default 4096 65536): messages per rank per step and seconds
   per check, old and new, from the simulation with the fitted parameters. Over a cluster's
   network a round costs more than between two processes on one host: ``--latency-us`` (the
   one-way latency of the network, default 2) is added per round of the new check and per
   step of the old (whose messages overlap).

The machine has 2 cores: with 3 and 4 ranks the processes share them, so those runs measure
time-sharing as well, which the model (a core per rank) leaves out; 8 ranks only with
``--real 1 2 3 4 8`` (slow). Record ``uptime``.

Usage::

    python benchmarks/step_check.py                      # about a minute on 2 cores
    python benchmarks/step_check.py --real 1 2 4 --checks 500 --reps 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
from common import machine_info, spread, venv_tool

TIMEOUT = 60.0


def rounds(p: int) -> int:
    """Rounds of recursive doubling on ``p`` ranks (MPICH's allreduce of a few bytes)."""
    low = 1 << (p.bit_length() - 1)
    return low.bit_length() - 1 + (2 if p > low else 0)


def simulate_new(p: int, c: float, g: float, latency: float = 0.0) -> tuple[float, int]:
    """``(seconds, most messages of a rank)`` of one reduction on ``p`` ranks that arrive
    together: each rank's clock played through its rounds (a round ends when both partners
    have reached it, ``g + latency`` later)."""
    low = 1 << (p.bit_length() - 1)
    clock = np.full(p, c)
    sent = np.zeros(p, dtype=np.int64)
    extra = np.arange(low, p)  # fold in: rank low + i gives its values to rank i
    step = g + latency
    if len(extra):
        clock[extra - low] = np.maximum(clock[extra - low], clock[extra]) + step
        sent[extra] += 1
    ranks = np.arange(low)
    for k in range(low.bit_length() - 1):
        partner = ranks ^ (1 << k)
        clock[:low] = np.maximum(clock[:low], clock[partner]) + step
        sent[:low] += 1
    if len(extra):  # and is told the result
        clock[extra] = clock[extra - low] + step
        sent[extra - low] += 1
    return float(clock.max()), int(sent.max() * 2)  # a message out and one in a round


def simulate_old(p: int, a: float, wait: float, m: float) -> tuple[float, int]:
    """``(seconds, messages of a rank)`` of the point-to-point check on ``p`` ranks: ``m`` a
    peer, and one ``wait`` for the messages, which overlap."""
    return a + (wait if p > 1 else 0.0) + m * (p - 1), 2 * (p - 1)


def per_peer(coll: object, reps: int = 200, peers: int = 64) -> float:
    """Seconds to post and test a message to and one from a peer (to itself, ``peers`` at
    once, as the old check posts them)."""
    import numpy as np

    comm = coll.comm  # type: ignore[attr-defined]
    mine, rooms = np.zeros(1, np.int64), np.zeros((peers, 1), np.int64)
    t0 = time.perf_counter()
    for _ in range(reps):
        recvs = [comm.Irecv(rooms[k], source=0, tag=7) for k in range(peers)]
        sends = [comm.Isend(mine, dest=0, tag=7) for _ in range(peers)]
        while not all(q.Test() for q in recvs + sends):
            pass
    return (time.perf_counter() - t0) / (reps * peers)


def job(checks: int) -> None:
    """One rank's part: seconds per check of each kind, gathered and printed by rank 0."""
    from mpi4py import MPI

    from datastore.ranks.agree import Collective

    world = MPI.COMM_WORLD
    coll = Collective(world)
    kinds = {
        "old": lambda: coll.allgather_ints([0], TIMEOUT, "the step check"),
        "new": lambda: coll.allreduce_max([2, -2, 0, 1, 0, 0], TIMEOUT, "the step check"),
    }
    got = {}
    for name, check in kinds.items():
        for _ in range(max(10, checks // 10)):
            check()
        world.Barrier()
        t0 = time.perf_counter()
        for _ in range(checks):
            check()
        got[name] = (time.perf_counter() - t0) / checks
    every = world.gather(got, root=0)
    if world.Get_rank() == 0:
        out = {k: statistics.mean(g[k] for g in every) for k in kinds}
        if world.Get_size() == 1:
            out["peer"] = per_peer(coll)
        print(json.dumps(out))
    coll.close()


def real_run(p: int, checks: int) -> dict[str, float]:
    """Seconds per check of each kind, the mean over ``p`` real ranks."""
    cmd = [venv_tool("mpiexec"), "-n", str(p), sys.executable, "-m", "mpi4py", __file__,
           "--job", "--checks", str(checks)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # fmt: off
    p.add_argument("--real", type=int, nargs="+", default=[1, 2, 3, 4],
                   help="ranks of the real runs (1 and 2 always run; default: 1 2 3 4)")
    p.add_argument("--simulate", type=int, nargs="+", default=[4096, 65536],
                   help="ranks simulated with the fitted model (default: 4096 65536)")
    p.add_argument("--checks", type=int, default=2000, help="checks per real run (default: 2000)")
    p.add_argument("--reps", type=int, default=3, help="real runs of each size (default: 3)")
    p.add_argument("--latency-us", type=float, default=2.0,
                   help="the network's one-way latency added at scale, us (default: 2)")
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    # fmt: on
    a = p.parse_args()
    if min(a.real + a.simulate) < 1 or a.checks < 1 or a.reps < 1 or a.latency_us < 0:
        p.error("--real, --simulate, --checks, --reps: each >= 1; --latency-us >= 0")
    if a.job:
        job(a.checks)
        return
    print(machine_info(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"))
    runs: dict[int, dict[str, list[float]]] = {}
    for size in sorted({1, 2, *a.real}):
        reps = [real_run(size, a.checks) for _ in range(a.reps)]
        runs[size] = {k: [r[k] for r in reps if k in r] for k in ("old", "new", "peer")}
    med = {s: {k: statistics.median(v) for k, v in r.items() if v} for s, r in runs.items()}
    a_, c_, m_ = med[1]["old"], med[1]["new"], med[1]["peer"]
    wait, g_ = max(0.0, med[2]["old"] - a_ - m_), med[2]["new"] - c_
    print(f"\nfrom 1 and 2 ranks: old = {a_ * 1e6:.1f} us + {wait * 1e6:.1f} us + "
          f"{m_ * 1e6:.2f} us x (P - 1); new = {c_ * 1e6:.1f} us + {g_ * 1e6:.1f} us x "
          "rounds\n")  # fmt: skip
    print("| P | rounds | old us/check (range) | model | error | new us/check (range) | model | "
          "error | fitted or checked |")  # fmt: skip
    print("|---:|---:|---|---:|---:|---|---:|---:|---|")
    for size, r in runs.items():
        old_m, new_m = simulate_old(size, a_, wait, m_)[0], simulate_new(size, c_, g_)[0]
        mo, mn = med[size]["old"], med[size]["new"]
        us_old, us_new = ([x * 1e6 for x in r[k]] for k in ("old", "new"))
        print(f"| {size} | {rounds(size)} | {mo * 1e6:.1f} ({spread(us_old, '{:.1f}')}) | "
              f"{old_m * 1e6:.1f} | {old_m / mo - 1:+.0%} | "
              f"{mn * 1e6:.1f} ({spread(us_new, '{:.1f}')}) | {new_m * 1e6:.1f} | "
              f"{new_m / mn - 1:+.0%} | {'fitted' if size <= 2 else 'checked'} |")  # fmt: skip
    print(f"\nload average after the runs: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    lat = a.latency_us * 1e-6
    print(f"\nSimulated, the fitted parameters plus {a.latency_us:g} us of network latency "
          "per round (new) or per check (old):\n")  # fmt: skip
    print("| P | old messages/rank/step | old s/check | new messages/rank/step | rounds | "
          "new s/check |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|")
    for size in a.simulate:
        (to, mo), (tn, mn) = simulate_old(size, a_, wait + lat, m_), simulate_new(size, c_, g_, lat)
        print(f"| {size} | {mo:,} | {to:.4f} | {mn} | {rounds(size)} | {tn:.6f} |")


if __name__ == "__main__":
    main()
