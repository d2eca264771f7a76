"""Read a dataset through ``DataStoreLoader`` for a few epochs and print the throughput.

``python -m datastore.demo_read PATH [--epochs 2] [--batch 4] [--parts 2,1,1 --halo 1,1,1]``,
alone or under ``mpiexec -n N python -m mpi4py -m datastore.demo_read ...``. Part of
``make demo``; also a minimal example of the loader in a script.
"""

from __future__ import annotations

import argparse
import os
import time

from datastore import DataStoreLoader


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=4, help="samples per step per data rank")
    p.add_argument("--parts", default=None, help="spatial blocks per axis, e.g. 2,1,1")
    p.add_argument("--halo", default="0,0,0")
    a = p.parse_args()
    spatial = None
    if a.parts:
        spatial = {
            "parts": tuple(map(int, a.parts.split(","))),
            "halo": tuple(map(int, a.halo.split(","))),
        }
    t0 = time.perf_counter()
    loader = DataStoreLoader(a.path, batch_size=a.batch, spatial=spatial)
    ready = time.perf_counter() - t0
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


if __name__ == "__main__":
    main()
