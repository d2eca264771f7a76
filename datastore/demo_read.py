"""Read a dataset through ``DataStoreLoader`` for a few epochs and print the throughput.

``python -m datastore.demo_read PATH [--epochs 2] [--batch 4] [--parts 2,1,1 --halo 1,1,1]``,
alone or under ``mpiexec -n N python -m mpi4py -m datastore.demo_read ...``; with
``--address SOCKET`` the batches come from ``datastore serve``. Part of ``make demo``; also a
minimal example of the loader in a script.
"""

from __future__ import annotations

import argparse
import os
import time

from datastore import DataStoreLoader
from staging.console import Parser


def main() -> None:
    p = Parser(prog="python -m datastore.demo_read", description=__doc__.splitlines()[0])
    p.add_argument("path")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=4, help="samples per step per data rank")
    p.add_argument("--parts", default=None, help="spatial blocks per axis, e.g. 2,1,1")
    p.add_argument("--halo", default="0,0,0")
    p.add_argument("--address", default=None, help="stream from `datastore serve` at this socket")
    p.add_argument("--job", default="", help="job id shown by `datastore status`")
    p.add_argument("--step-ms", type=float, default=0.0, help="simulated compute per batch")
    a = p.parse_args()
    spatial = None
    if a.parts:
        spatial = {
            "parts": tuple(map(int, a.parts.split(","))),
            "halo": tuple(map(int, a.halo.split(","))),
        }
    t0 = time.perf_counter()
    kw = {"address": a.address, "job_id": a.job} if a.address else {}
    loader = DataStoreLoader(a.path, batch_size=a.batch, spatial=spatial, **kw)
    ready = time.perf_counter() - t0
    if a.address:
        _stream(loader, a, ready)
        return
    w = loader.world
    for epoch in range(a.epochs):
        t0 = time.perf_counter()
        nbytes = 0
        for batch in loader:
            nbytes += sum(t.numel() * t.element_size() for t in batch.values())
        dt = time.perf_counter() - t0
        if w.rank == 0:
            shape = tuple(batch["x"].shape) if "x" in batch else None
            print(
                f"rank 0 of {w.size} ({w.source}): epoch {epoch}: {len(loader)} batches of "
                f"x{shape}, {nbytes / dt / 1e6:.0f} MB/s"
                + (f" (store ready in {ready:.2f} s)" if epoch == 0 else ""),
                flush=True,
            )
    c = loader.counters
    if w.rank == 0 and w.size > (os.cpu_count() or 1):
        print(
            f"note: {w.size} ranks on {os.cpu_count()} cores: oversubscribed, and MPI ranks "
            "busy-poll while they wait, so this throughput says little",
            flush=True,
        )
    if w.rank == 0:
        print(
            f"rank 0 store: {c.bytes_resident / 1e6:.1f} MB resident, {c.hits} hits, "
            f"{c.misses} misses, {c.bytes_exchanged / 1e6:.1f} MB sent to peers",
            flush=True,
        )
    loader.close()


def _stream(loader: DataStoreLoader, a: argparse.Namespace, ready: float) -> None:
    """The same epochs from the service: one line per epoch from this rank."""
    for epoch in range(a.epochs):
        t0 = time.perf_counter()
        nbytes = 0
        for b in loader:
            nbytes += sum(t.numel() * t.element_size() for t in b.values())
            time.sleep(a.step_ms / 1e3)
        dt = time.perf_counter() - t0
        print(
            f"job {a.job or '-'} rank {loader.world.rank} of {loader.world.size} (service): epoch "
            f"{epoch}: {len(loader)} batches, {nbytes / dt / 1e6:.0f} MB/s"
            + (f" with {a.step_ms:.0f} ms of compute per batch" if a.step_ms else "")
            + (f" (session open in {ready:.2f} s)" if epoch == 0 else ""),
            flush=True,
        )
    loader.close()


if __name__ == "__main__":
    main()
