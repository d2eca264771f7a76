"""Benchmark the trainer: its input pipeline and the costs of spatial and data parallelism.

What is measured
----------------
A synthetic cosmology dataset (``trainer.cosmology``: ``--samples`` samples of ``--side``^3,
4 channels, default 128 of 32^3) is written once under ``--dir`` (default
``./bench-data/trainer``), a file per samples and side. The model is CosmoFlow
(``conv_size = --width``, 4 blocks).

a. **Input pipeline under training**: ``--steps`` SGD steps of batch ``--batch`` fed by
   ``DataStoreLoader(train.h5, batch_size, seed=0)`` vs the stock
   ``torch.utils.data.DataLoader(ds, batch_size, shuffle=True, drop_last=True,
   persistent_workers=True, pin_memory=<CUDA available>)`` over a map-style Dataset reading one
   sample per ``__getitem__`` from the same HDF5 file, with each ``num_workers`` of
   ``--workers`` (default: 1, the cores and twice the cores). Per run: the median step time and
   the data-wait share (time blocked fetching the next batch / step time, summed over the
   steps after the first). ``--reps`` runs of each, the order alternating; printed: the median
   over the reps and the full range. Ratio = the fastest peer setting's step time / ours.
b. **Activation memory** (``benchmarks/train_step_job.py`` under ``mpiexec -n 2``): bytes autograd
   saves for one forward, a rank's half of the sample (parts (2, 1, 1)) vs the whole sample in
   one process. Target <= 0.6x.
c. **Halo exchange share** (same job): the time inside the halo exchange, forward and backward,
   over the training step of the split model on 2 ranks (medians, slowest rank).
d. **Lion Cub** (same job, 2 data ranks): bytes this rank hands to the vote collectives vs an
   fp32 gradient all-reduce (``opt.comm``), ``int8`` and ``packed``.

Usage::

    python benchmarks/train_step.py            # about a minute on 2 cores
    python benchmarks/train_step.py --steps 10 --samples 64 --reps 1 --workers 2
    python benchmarks/train_step.py --json benchmarks/results/train_step.json  # for report.py
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
from collections.abc import Callable, Iterable
from typing import Any

import torch
from common import (
    cores,
    key_ratio,
    machine_info,
    median,
    parse_counts,
    spread,
    stats,
    venv_tool,
    write_results,
)
from loader import H5Samples
from train_step_job import BLOCKS

from datastore import DataStoreLoader
from trainer.cosmology import write_dataset
from trainer.models import CosmoFlow
from trainer.preflight import level_blocks

HERE = os.path.dirname(os.path.abspath(__file__))


def train_steps(batches: Iterable[dict[str, torch.Tensor]], steps: int, width: int, side: int):
    """``(median step seconds, data-wait share)`` of ``steps`` SGD steps (the first dropped)."""
    torch.manual_seed(0)
    model = CosmoFlow(4, 3, input_size=side, conv_size=width, n_conv=BLOCKS)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    it = iter(batches)
    times, waits = [], []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        batch = next(it)
        t1 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(batch["x"]), batch["y"]).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        waits.append(t1 - t0)
    return statistics.median(times[1:]), sum(waits[1:]) / sum(times[1:])


def forever(make: Callable[[], Iterable]) -> Iterable[dict[str, torch.Tensor]]:
    while True:
        yield from make()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default="bench-data/trainer")
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--side", type=int, default=32)
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--reps", type=int, default=3, help="runs of each input pipeline")
    p.add_argument("--workers", default="auto", help="peer num_workers to try (default: auto)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    a = p.parse_args()
    try:  # (a) trains on whole samples, (b)-(d) on halves: both checked before any run
        for parts in ((1, 1, 1), (2, 1, 1)):
            level_blocks((a.side,) * 3, parts, BLOCKS)
    except ValueError as exc:
        p.error(f"--side {a.side}: {exc}")
    if min(a.samples, a.width, a.batch, a.steps) < 1 or a.batch > a.samples:
        p.error("--samples, --width, --batch, --steps: each >= 1, and --batch <= --samples")
    c = cores()
    workers = parse_counts(a.workers, sorted({1, c, 2 * c}), "--workers")
    if workers[0] < 1 or a.reps < 1:
        p.error("--workers: counts >= 1; --reps >= 1")
    torch.set_num_threads(1)
    path = os.path.join(a.dir, f"train-{a.samples}x{a.side}.h5")  # (a --dir holds several)
    if not os.path.exists(path):
        os.makedirs(a.dir, exist_ok=True)
        write_dataset(path, a.samples, a.side, 0)
    print(machine_info(f"torch {torch.__version__}"))
    pin = torch.cuda.is_available()

    def ours() -> tuple[float, float]:
        loader = DataStoreLoader(path, batch_size=a.batch, fields=["x", "y"], seed=0)
        try:
            return train_steps(forever(lambda: loader), a.steps, a.width, a.side)
        finally:
            loader.close()

    def peer(w: int) -> tuple[float, float]:
        loader = torch.utils.data.DataLoader(
            H5Samples(path), batch_size=a.batch, shuffle=True, drop_last=True, num_workers=w,
            persistent_workers=True, pin_memory=pin,
        )  # fmt: skip
        return train_steps(forever(lambda: loader), a.steps, a.width, a.side)

    sides: dict[str, Callable[[], tuple[float, float]]] = {"DataStoreLoader": ours}
    for w in workers:
        sides[f"DataLoader(num_workers={w})"] = lambda w=w: peer(w)
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
    for rep in range(a.reps):
        for name in list(sides) if rep % 2 == 0 else list(sides)[::-1]:
            runs[name].append(sides[name]())
    print(
        f"\n(a) {a.steps} training steps, batch {a.batch} of {a.side}^3, width {a.width}; "
        f"median [range] over {a.reps} rep(s); peers: persistent_workers=True, pin_memory={pin}"
    )
    for name, got in runs.items():
        steps = [t * 1e3 for t, _ in got]
        waits = [w for _, w in got]
        print(
            f"  {name:26s} step {median(steps):7.1f} ms [{spread(steps, '{:.1f}')}], "
            f"data wait {median(waits):6.1%} [{spread(waits, '{:.1%}')}]"
        )
    step = {name: median([t for t, _ in got]) for name, got in runs.items()}
    best = min((n for n in runs if n != "DataStoreLoader"), key=step.__getitem__)
    ratio = step[best] / step["DataStoreLoader"]
    print(f"  step time ratio peer / ours: {ratio:.2f}x (peer: the fastest, {best})")

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "job.json")
        cmd = [venv_tool("mpiexec"), "-n", "2", sys.executable, "-m", "mpi4py"]
        cmd += [os.path.join(HERE, "train_step_job.py"), out, str(a.side), str(a.width)]
        cmd += [str(a.batch), str(a.steps)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, check=True, env=env)
        with open(out) as fh:
            r = json.load(fh)
    act, halo = r["activations"], r["halo"]
    print(f"\n(b) saved activations of one forward, batch {a.batch}:")
    print(f"  whole sample {act['whole'] / 2**20:.1f} MiB, 2-way split {act['split'] / 2**20:.1f}")
    print(f"  MiB per rank: ratio {act['ratio']:.2f}x (target <= 0.6x)")
    print("\n(c) halo exchange on 2 ranks (forward + backward), medians, slowest rank:")
    print(f"  {halo['halo_s'] * 1e3:.1f} ms of a {halo['step_s'] * 1e3:.1f} ms step", end="")
    print(f" = {halo['share']:.1%}")
    print("\n(d) Lion Cub vs an fp32 all-reduce, 2 data ranks:")
    for mode, c in r["lion_cub"].items():
        print(
            f"  {mode:6s}: {c['bytes_sent']} of {c['bytes_fp32']} bytes over {c['steps']} steps"
            f" ({c['params']} parameters): saved {c['bytes_saved']}, ratio {c['ratio']:.3f}"
        )
    if a.json:
        write_results(
            a.json, "train_step", *as_json(a, runs, best, r), f"torch {torch.__version__}"
        )


def as_json(
    a: argparse.Namespace,
    runs: dict[str, list[tuple[float, float]]],
    best: str,
    job: dict[str, Any],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The results (per input pipeline: step ms and data-wait share with their ranges; the
    MPI job's figures) and the key ratios: step time and data-wait share vs the fastest peer."""
    pipelines = {
        name: {
            "step_ms": stats([t * 1e3 for t, _ in got]),
            "wait_share": stats([w for _, w in got]),
        }
        for name, got in runs.items()
    }
    ours, peer = pipelines["DataStoreLoader"], pipelines[best]
    settings = {k: v for k, v in vars(a).items() if k != "json"}
    ratio = peer["step_ms"]["median"] / ours["step_ms"]["median"]
    results = {"settings": settings, "pipelines": pipelines, "best_peer": best, "job": job}
    key = [
        key_ratio(
            f"training step ({a.side}^3, batch {a.batch}, width {a.width}) vs {best}",
            ours=ours["step_ms"]["median"],
            peer=peer["step_ms"]["median"],
            unit="ms",
            ratio=ratio,
            of="peer time / ours",
        ),
        key_ratio(
            f"data-wait share of the training step vs {best}",
            ours=ours["wait_share"]["median"],
            peer=peer["wait_share"]["median"],
            unit="share",
            ratio=None,
            of="",
        ),
    ]
    return results, key


if __name__ == "__main__":
    main()
