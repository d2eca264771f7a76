"""Two ranks under ``mpiexec -n 2``, one HDF5 file per sample (4 samples: rank 0 holds 0-1,
rank 1 holds 2-3), where sample 2 cannot be read: a ``shape`` of (5,) for (4,), or a ``vds``
whose virtual source is gone. Rank 1's preload fails when the loader is made (timeout 10 s);
rank 0 then takes the pass. Each rank writes ``OUT.RANK.json``: per case, its error's kind
and text and the seconds until it.

Usage: preload_fails_job.py DIR OUT CASE...
"""

from __future__ import annotations

import json
import os
import sys
import time

import h5py
import numpy as np
from job_rows import write_row
from mpi4py import MPI

from datastore import DataStoreLoader


def write_case(root: str, case: str) -> str:
    """The spec of ``case``'s files in ``root/case``."""
    d = os.path.join(root, case)
    os.makedirs(d)
    for k in range(4):
        name = os.path.join(d, f"q{k}.h5")
        with h5py.File(name, "w") as f:
            if k != 2:
                f["x"] = np.full(4, k, np.float32)
            elif case == "shape":
                f["x"] = np.full(5, k, np.float32)
            else:
                with h5py.File(os.path.join(d, "src.h5"), "w") as g:
                    g["x"] = np.full(4, k, np.float32)
                layout = h5py.VirtualLayout((4,), np.float32)
                layout[:] = h5py.VirtualSource("src.h5", "x", shape=(4,))
                f.create_virtual_dataset("x", layout)
    if case == "vds":
        os.remove(os.path.join(d, "src.h5"))
    spec = os.path.join(d, "set.json")
    with open(spec, "w") as f:
        json.dump({"format": "hdf5-per-sample", "paths": [f"q{k}.h5" for k in range(4)]}, f)
    return spec


def main() -> None:
    root, out, *cases = sys.argv[1:]
    comm = MPI.COMM_WORLD
    row: dict = {}
    for case in cases:
        spec = write_case(root, case) if comm.rank == 0 else None
        spec = comm.bcast(spec)
        t0 = time.monotonic()
        try:
            batches = list(DataStoreLoader(spec, 1, shuffle=False, timeout=10))
            row[case] = {"error": None, "batches": len(batches)}
        except Exception as exc:
            row[case] = {"error": [type(exc).__name__, str(exc)], "seconds": time.monotonic() - t0}
        comm.Barrier()
    write_row(out, comm.rank, row)


if __name__ == "__main__":
    main()
