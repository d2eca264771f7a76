"""Run under ``mpiexec -n 2 python -m mpi4py``: the traps over epochs through the real MPI
exchange (issue 11, traps 1, 3, 4, 6, 12), where batches are filled by ``MpiExchange``, not by
the one-process ``LocalSource``. Each rank writes one JSON file per case
(``DIR/CASE.RANK.json``); a traceback goes to its stderr, each line tagged ``[RANK:CASE]``.

Cases:
  consume_spatial / consume_data: 3 epochs, each taken as ``islice(loader, len(loader))``
    (Lightning's way, no ``set_epoch``). Epoch 0's batches are kept (trap 3); epochs 1 and 2
    are edited in place after checking (trap 12). Every batch is compared with the file: the
    whole box with its zero border (``consume_spatial``: parts (2, 1, 1), halo 1) or the rows
    (``consume_data``: global batch 6 over 16 samples with ``drop_last=False``: trap 4).
  stop_idle: rank 1 breaks after its first batch and never iterates again (it stays alive);
    rank 0 tries epoch after epoch (2 tries), catching each error (trap 6).
  stop_again: rank 1 breaks after its first batch in each of 2 epochs; rank 0 tries 2 epochs.

Usage: traps_epochs_job.py CASE[,CASE...] DIR DATASET  (the cases one after the other)
"""

from __future__ import annotations

import itertools
import os
import sys
import time
import traceback

import h5py
import numpy as np
from job_rows import write_row
from mpi4py import MPI

from datastore import DataStoreLoader

TIMEOUT = 5.0


def expected_box(x: np.ndarray, block: int, halo: int, parts: int) -> np.ndarray:
    """Block ``block`` of ``parts`` along the first spatial axis of ``x`` (samples, C, D, D, D),
    with ``halo`` voxels on every side, zero outside the volume: by ``np.pad`` and a slice,
    independent of the loader's partition code."""
    d = x.shape[2] // parts
    padded = np.pad(x, ((0, 0), (0, 0), (halo, halo), (halo, halo), (halo, halo)))
    return padded[:, :, block * d : block * d + d + 2 * halo]


def error_row(exc: BaseException, seconds: float, case: str) -> dict:
    rank = MPI.COMM_WORLD.Get_rank()
    tagged = (f"[{rank}:{case}] {line}\n" for line in traceback.format_exc().splitlines())
    sys.stderr.write("".join(tagged))  # tagged, the test reads each rank's; one write: the
    sys.stderr.flush()  # ranks share a pipe, and a line written in pieces can be split
    return {
        "kind": type(exc).__name__,
        "text": str(exc),
        "timeout_error": isinstance(exc, TimeoutError),
        "value_error": isinstance(exc, ValueError),
        "step": getattr(exc, "step", None),
        "peers": list(getattr(exc, "peers", ())),
        "seconds": seconds,
    }


def consume(case: str, path: str, rank: int, x_all: np.ndarray) -> dict:
    spatial = case == "consume_spatial"
    if spatial:  # one data rank, two blocks: both ranks take the same samples
        kw = {"global_batch_size": 2, "spatial": {"parts": (2, 1, 1), "halo": 1}}
    else:  # two data ranks; 16 = 2 * 6 + 4: the last step is padded with 2 repeats
        kw = {"global_batch_size": 6, "drop_last": False}
    loader = DataStoreLoader(path, seed=3, prefetch=2, timeout=TIMEOUT, **kw)

    def want(ids: list[int]) -> np.ndarray:
        if spatial:
            return expected_box(x_all[ids], rank, 1, 2)
        return x_all[ids]

    out: dict = {"source": loader.source, "len": len(loader), "epochs": []}
    kept: list[tuple[list[int], dict]] = []
    for epoch in range(3):
        row: dict = {"ids": [], "valid": [], "bad": 0, "positions": []}
        for b in itertools.islice(loader, len(loader)):
            ids = b["idx"].tolist()
            row["ids"].append(ids)
            row["positions"].append([loader.epoch, loader.state_dict()["step"]])
            if "valid" in b:
                row["valid"].append(b["valid"].tolist())
            if not np.array_equal(b["x"].numpy(), want(ids)):
                row["bad"] += 1
            if epoch == 0:  # kept, not edited: later epochs must not write into them
                kept.append((ids, b))
            else:  # a consumer normalising in place
                b["x"].mul_(0).add_(7)
                b["idx"].mul_(0)
                if "valid" in b:
                    b["valid"].fill_(False)
        state = loader.state_dict()
        row["after"] = [loader.epoch, state["epoch"], state["step"]]
        out["epochs"].append(row)
    out["kept_bad"] = sum(
        int(b["idx"].tolist() != ids or not np.array_equal(b["x"].numpy(), want(ids)))
        for ids, b in kept
    )
    out["kept"] = len(kept)
    loader.close()
    return out


def stop(case: str, path: str, rank: int, out_prefix: str, x_all: np.ndarray) -> dict:
    # 8 steps: more than prefetch keeps ahead, so rank 1's prefetch cannot exchange the whole
    # epoch before its loop breaks (rank 0 would then rightly get the epoch with no error)
    loader = DataStoreLoader(path, global_batch_size=2, seed=1, timeout=TIMEOUT)
    tries = []
    for _ in range(2):  # rank 0: a whole epoch, then the next; rank 1: see the case
        t0 = time.monotonic()
        row: dict = {"ids": [], "bad": 0, "error": None}
        if rank == 1 and case == "stop_idle" and tries:
            break  # rank 1 never iterates again
        try:
            for i, b in enumerate(loader):
                ids = b["idx"].tolist()
                row["ids"].append(ids)
                if not np.array_equal(b["x"].numpy(), x_all[ids]):
                    row["bad"] += 1
                if rank == 1 and i == 0:
                    break
        except Exception as exc:  # what this try raised, for the test
            row["error"] = error_row(exc, time.monotonic() - t0, case)
        row["seconds"] = time.monotonic() - t0
        row["position"] = [loader.epoch, loader.state_dict()["step"]]
        tries.append(row)
    if rank == 1:  # stay alive (like a trainer doing other work) until rank 0 is done
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and not os.path.exists(f"{out_prefix}.0.json"):
            time.sleep(0.1)
    return {"tries": tries}


def main() -> None:
    cases, out_dir, path = sys.argv[1:4]
    rank = MPI.COMM_WORLD.Get_rank()
    with h5py.File(path, "r") as f:
        x_all = f["x"][...]
    for case in cases.split(","):
        out_prefix = os.path.join(out_dir, case)
        out: dict = {"rank": rank, "error": None}
        try:
            if case.startswith("consume"):
                out.update(consume(case, path, rank, x_all))
            else:
                out.update(stop(case, path, rank, out_prefix, x_all))
        except Exception as exc:  # an error outside what the case expects
            out["error"] = error_row(exc, 0.0, case)
        write_row(out_prefix, rank, out)


if __name__ == "__main__":
    main()
