"""Run under ``mpiexec -n N python -m mpi4py``: iterate a DataStoreLoader, check every block
against the file, and have rank 0 write the global sample sequence as JSON.

Usage: loader_job.py DATASET OUT_JSON GLOBAL_BATCH EPOCHS [PARTS HALO]
"""

from __future__ import annotations

import json
import sys

import h5py
import numpy as np
from mpi4py import MPI

from datastore import DataStoreLoader
from datastore.maths.partition import Grid, extract_block


def main() -> None:
    path, out, gb, epochs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    spatial = None
    if len(sys.argv) > 5:
        parts = tuple(int(p) for p in sys.argv[5].split(","))
        halo = tuple(int(h) for h in sys.argv[6].split(","))
        spatial = {"parts": parts, "halo": halo, "boundary": "zero"}
    comm = MPI.COMM_WORLD
    loader = DataStoreLoader(path, global_batch_size=gb, seed=11, spatial=spatial, prefetch=2)
    with h5py.File(path, "r") as f:
        x_all, idx_all = f["x"][...], f["idx"][...]
    grid = loader.grid
    k = comm.Get_rank() % grid.nblocks if grid is not None else 0
    sequence = []
    for epoch in range(epochs):
        for batch in loader:
            ids = batch["idx"].numpy().copy()
            for j, i in enumerate(ids):
                want = x_all[i]
                if grid is not None:
                    want = extract_block(
                        want, Grid(grid.shape, grid.parts, grid.halo, grid.boundary), k, (1, 2, 3)
                    )
                if not np.array_equal(batch["x"].numpy()[j], want):
                    raise SystemExit(f"rank {comm.Get_rank()} epoch {epoch}: wrong data for {i}")
                assert idx_all[i] == i
            sequence.append(ids.tolist())
    gathered = comm.gather(sequence, root=0)
    if comm.Get_rank() == 0:
        blocks = grid.nblocks if grid is not None else 1
        data_ranks = gathered[::blocks]  # one rank per data-parallel group (block 0)
        steps = [[i for r in data_ranks for i in r[s]] for s in range(len(sequence))]
        with open(out, "w") as f:
            json.dump({"steps": steps, "bytes_exchanged": loader.counters.bytes_exchanged}, f)
    loader.close()


if __name__ == "__main__":
    main()
