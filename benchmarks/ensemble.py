"""Benchmark a queue of short jobs on one resident dataset against each job reading it itself.

What is measured
----------------
One HDF5 file written by h5py under ``--dir`` (default ``./bench-data/ensemble``):
``--samples`` N (default 512) samples of ``x`` float32 (4, S, S, S), S = ``--side`` (default
32: 512 KiB a sample, 256 MiB in all), one chunk per sample, and ``y`` float32 (3,). A *job* is
a new Python process that imports ``datastore`` and torch, builds a loader, runs one epoch of
``--batch`` B samples a step (default 16), touching each batch (and burning
``--compute-ms`` of simulated compute per step, default 0, ``common.Compute``), and exits.
``--jobs`` J jobs (default 20), job ``j`` with seed ``j``, run ``--at-once`` P at a time
(default 3): a queue that starts the next job as soon as one ends. The same queue runs twice:

- **service**: one ``datastore serve`` (``common.Service``: a Unix socket, default settings)
  holds the dataset; the campaign first makes it resident (``LoadDataset`` with ``wait``, as
  ``datastore load --wait`` does: timed, and counted in the queue's total), then every job
  builds ``DataStoreLoader(path, batch_size=B, seed=j, service=ServiceOptions(SOCK))``;
- **embedded**: every job builds ``DataStoreLoader(path, batch_size=B, seed=j)``, as a user
  would with no service: the loader's defaults (it preloads the dataset into its own memory
  before the first batch).

Per job: *time to first batch*, from the loader's construction (after the imports, the
client's gRPC modules included) to the first batch in hand; *loader* time, from the
construction to the end of the epoch; and the job's *wall time*, from the process's start to
its exit (imports included, the same in both modes). Per queue: the *total*, from the first
job's start (the service's load included) to the last job's end. Printed: medians and full
ranges over the J jobs, the ratios embedded / service, and the service's own counters
(``Status``: the store counts one read per sample and field; *read from disk* = ``misses /
fields``, *delivered* = ``hits / fields``). The page cache is dropped before each queue when
this process may (root), else the report says it was not (both queues then read from a warm
cache, which favours the embedded loader).

Usage::

    python benchmarks/ensemble.py                     # ~2 minutes on 2 cores
    python benchmarks/ensemble.py --jobs 8 --at-once 2 --samples 256
    python benchmarks/ensemble.py --side 64 --compute-ms 20 --out /tmp/ensemble.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import h5py
import numpy as np
from common import (
    TAG,
    PageCache,
    Service,
    key_ratio,
    machine_info,
    median,
    say,
    spread,
    stats,
    write_results,
)

MIB = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MODES = ("service", "embedded")
TIMES = ("first_batch_s", "loader_s", "wall_s")  # what each job reports, in seconds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="./bench-data/ensemble", help="where the dataset is written")
    p.add_argument("--samples", type=int, default=512, help="samples N (default 512)")
    p.add_argument("--side", type=int, default=32, help="x is (4,S,S,S) float32 (default 32)")
    p.add_argument("--batch", type=int, default=16, help="samples per step B (default 16)")
    p.add_argument("--jobs", type=int, default=20, help="jobs in the queue J (default 20)")
    p.add_argument("--at-once", type=int, default=3, help="jobs running at a time P (default 3)")
    p.add_argument("--compute-ms", type=float, default=0.0, help="compute per step (default 0)")
    p.add_argument("--warm", action="store_true", help="never drop the page cache")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the report here")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    p.add_argument("--job", default=None, help=argparse.SUPPRESS)  # a child: JSON arguments
    args = p.parse_args(argv)
    if args.job is not None:
        return args
    for name in ("samples", "side", "batch", "jobs", "at_once"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be at least 1")
    if args.batch > args.samples:
        p.error(f"--batch {args.batch} is more than --samples {args.samples}")
    if args.compute_ms < 0:
        p.error("--compute-ms: must not be negative")
    return args


def write_dataset(work: str, n: int, side: int) -> str:
    """``work/ensemble.h5`` with ``n`` samples of ``x`` (4, side^3) and ``y`` (3,), reused when
    it already has that shape."""
    os.makedirs(work, exist_ok=True)
    path = os.path.abspath(os.path.join(work, "ensemble.h5"))
    shape = (4, side, side, side)
    with contextlib.suppress(OSError), h5py.File(path, "r") as f:
        if f["x"].shape == (n, *shape) and f["y"].shape == (n, 3):
            return path
    print(f"generating {n} samples x {16 * side**3 / MIB:.2f} MiB in {path} ...", flush=True)
    rng = np.random.default_rng(0)
    tmp = path + ".tmp"
    with h5py.File(tmp, "w") as f:
        x = f.create_dataset("x", (n, *shape), "f4", chunks=(1, *shape))
        for i in range(n):
            x[i] = rng.random(shape, dtype=np.float32)
        f.create_dataset("y", data=rng.random((n, 3), dtype=np.float32))
    os.replace(tmp, path)
    os.sync()
    return path


# ----------------------------------------------------------------------------- one job


def job(spec: dict) -> None:
    """A child: one epoch of its own loader; reports its timings as one tagged JSON line."""
    import torch  # noqa: F401  (a training job's imports, before the clock)
    from common import Compute

    import datastore.sources.service  # noqa: F401  (the client's gRPC modules, likewise)
    from datastore import DataStoreLoader, ServiceOptions

    compute = Compute(spec["compute_ms"])
    kw = {"service": ServiceOptions(spec["address"])} if spec["address"] else {}
    t0 = time.monotonic()
    loader = DataStoreLoader(spec["path"], batch_size=spec["batch"], seed=spec["seed"], **kw)
    first = None
    steps = 0
    for batch in loader:
        if first is None:
            first = time.monotonic() - t0
        float(batch["x"][0, 0, 0, 0, 0])  # touch it
        compute()
        steps += 1
    loader.close()
    say(json.dumps({"first_batch_s": first, "loader_s": time.monotonic() - t0, "steps": steps}))


# ----------------------------------------------------------------------------- the queue


@dataclass
class Done:
    seed: int
    wall_s: float
    first_batch_s: float
    loader_s: float
    steps: int


def run_queue(args: argparse.Namespace, path: str, address: str | None) -> tuple[list[Done], float]:
    """Run the jobs, ``at_once`` at a time; ``(finished jobs, seconds from the first start to
    the last end)``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, HERE]))}
    env["OMP_NUM_THREADS"] = "1"
    waiting = list(range(args.jobs))
    running: dict[int, tuple[subprocess.Popen, float]] = {}
    done: list[Done] = []
    t0 = time.monotonic()
    while waiting or running:
        while waiting and len(running) < args.at_once:
            seed = waiting.pop(0)
            spec = {"path": path, "batch": args.batch, "seed": seed, "address": address,
                    "compute_ms": args.compute_ms}  # fmt: skip
            cmd = [sys.executable, os.path.abspath(__file__), "--job", json.dumps(spec)]
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
            running[seed] = (proc, time.monotonic())
        for seed, (proc, start) in list(running.items()):
            if proc.poll() is None:
                continue
            end = time.monotonic()
            out = proc.stdout.read() if proc.stdout else ""
            lines = [ln[len(TAG) :] for ln in out.splitlines() if ln.startswith(TAG)]
            if proc.returncode != 0 or not lines:
                sys.exit(f"job {seed} failed (exit {proc.returncode}):\n{out[-2000:]}")
            got = json.loads(lines[-1])
            done.append(
                Done(seed, end - start, got["first_batch_s"], got["loader_s"], got["steps"])
            )
            del running[seed]
        time.sleep(0.01)
    return done, time.monotonic() - t0


def counters(service: Service, path: str) -> tuple[int, int]:
    """``(reads from disk, reads from memory)`` of the service's store for ``path``, per
    sample (the store counts one per sample and field)."""
    (ds,) = [d for d in service.status().datasets if d.path == path]
    with h5py.File(path, "r") as f:
        fields = len(f.keys())
    return ds.misses // fields, ds.hits // fields


# ----------------------------------------------------------------------------- report


def row(name: str, jobs: list[Done], total: float) -> str:
    first = [j.first_batch_s for j in jobs]
    loader = [j.loader_s for j in jobs]
    wall = [j.wall_s for j in jobs]
    return (
        f"| {name} | {total:.1f} | {median(first):.3f} ({spread(first, '{:.3f}')}) | "
        f"{median(loader):.2f} ({spread(loader)}) | {median(wall):.2f} ({spread(wall)}) |"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.job is not None:
        job(json.loads(args.job))
        return 0
    path = write_dataset(args.dir, args.samples, args.side)
    cache = PageCache(args.warm)
    steps = args.samples // args.batch
    results: dict[str, tuple[list[Done], float]] = {}
    load_before = os.getloadavg()[0]
    service = Service()
    try:
        cache.drop()
        t0 = time.monotonic()
        service.load(path)
        load_s = time.monotonic() - t0
        jobs, queue_s = run_queue(args, path, service.socket)
        results["service"] = (jobs, load_s + queue_s)
        read, delivered = counters(service, path)
    finally:
        service.stop()
    cache.drop()
    results["embedded"] = run_queue(args, path, None)
    for name, (jobs, _) in results.items():
        bad = [j.seed for j in jobs if j.steps != steps]
        if bad:
            sys.exit(f"{name}: jobs {bad} ran other than {steps} steps")
    (svc, svc_total), (emb, emb_total) = results["service"], results["embedded"]

    def ratio(f: str) -> float:
        return median([getattr(j, f) for j in emb]) / median([getattr(j, f) for j in svc])

    mib = args.samples * 16 * args.side**3 / MIB
    lines = [
        f"# Ensemble: {args.jobs} one-epoch jobs, {args.at_once} at a time, one dataset",
        "",
        f"- dataset: {args.samples} samples of x (4, {args.side}^3) float32 + y, "
        f"{mib:.0f} MiB, HDF5 one chunk per sample; batch {args.batch} ({steps} steps a job), "
        f"compute {args.compute_ms:g} ms a step",
        f"- page cache: {cache.note}",
        f"- machine: {machine_info(f'h5py {h5py.__version__}')}; load average (1 min) "
        f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after",
        "",
        "| mode | total s | first batch s, median (range) | loader s | job wall s |",
        "|---|---:|---:|---:|---:|",
        row("service", svc, svc_total),
        row("embedded", emb, emb_total),
        "",
        f"- ratios embedded / service (medians): total {emb_total / svc_total:.2f}x, first "
        f"batch {ratio('first_batch_s'):.1f}x, loader {ratio('loader_s'):.2f}x, job wall "
        f"{ratio('wall_s'):.2f}x",
        "- first batch: loader construction to the first batch in hand; loader: construction "
        "to the epoch's end; job wall: process start to exit (imports included)",
        f"- service: LoadDataset (wait) {load_s:.2f} s, counted in its total; samples read "
        f"from disk {read}, delivered {delivered} ({delivered / max(read, 1):.1f}x; "
        f"{args.jobs} jobs x {steps * args.batch} = {args.jobs * steps * args.batch})",
        f"- embedded: every job read all {args.samples} samples itself "
        f"({args.jobs * args.samples} reads)",
    ]
    report = "\n".join(lines)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n")
    if args.json:
        per_job = {
            name: {f: stats([getattr(j, f) for j in jobs]) for f in TIMES}
            for name, (jobs, _) in results.items()
        }
        ratios = [
            key_ratio("ensemble: queue total", ours=svc_total, peer=emb_total, unit="s",
                      ratio=emb_total / svc_total, of="embedded / service"),
            key_ratio("ensemble: time to first batch", ours=median([j.first_batch_s for j in svc]),
                      peer=median([j.first_batch_s for j in emb]), unit="s",
                      ratio=ratio("first_batch_s"), of="embedded / service"),
        ]  # fmt: skip
        results_doc = {
            "jobs": args.jobs, "at_once": args.at_once, "samples": args.samples,
            "side": args.side, "batch": args.batch, "totals_s": {"service": svc_total,
            "embedded": emb_total}, "load_s": load_s, "per_job": per_job,
            "read_from_disk": read, "delivered": delivered,
        }  # fmt: skip
        write_results(args.json, "ensemble", results_doc, ratios)
    return 0


if __name__ == "__main__":
    sys.exit(main())
