"""``make demo``: stage a small dataset, read it, then run a whole campaign on one store.

Writes under ``./demo-data`` (``DATASTORE_DEMO_DIR`` overrides): ``pfs/`` plays the parallel
filesystem (CosmoFlow-like volumes and labels in one HDF5 file, a tree of ``.npy`` volumes, and
a ``.tar.zst`` shard of more volumes), ``ssd/`` plays node-local storage. The staged HDF5 is
read through ``DataStoreLoader``: one rank, then four MPI ranks as a 2 x 2 data x spatial grid,
each receiving only its half of every volume plus a one-voxel halo. Then the campaign
(``deploy/campaign-local.sh`` with ``deploy/demo.jobs``): a small synthetic cosmology dataset is
staged, one ``datastore serve`` holds it, an ensemble of three short trainings and a hybrid
2 x 2 data x spatial training run at once against it, then a tournament of three trainers;
``datastore status``, a clean shutdown, and a summary of what happened and how fast.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time

import h5py
import numpy as np
import zstandard

from staging.launcher import mpiexec_command

__all__ = ["main"]

SAMPLES, SIDE, CHANNELS = 24, 32, 4


def generate(pfs: str, seed: int = 0) -> None:
    """Volumes as ``.npy`` in a tree, labels in HDF5, and a zstd tar shard of more volumes."""
    rng = np.random.default_rng(seed)
    vol_dir = os.path.join(pfs, "cosmo", "extra")
    os.makedirs(vol_dir, exist_ok=True)
    labels = rng.uniform(-1, 1, size=(SAMPLES, 4)).astype(np.float32)
    volumes = rng.standard_normal((SAMPLES, CHANNELS, SIDE, SIDE, SIDE), dtype=np.float32)
    with h5py.File(os.path.join(pfs, "cosmo", "train.h5"), "w") as f:
        f.create_dataset("x", data=volumes, chunks=(1, CHANNELS, SIDE, SIDE, SIDE))
        f.create_dataset("y", data=labels)
    for i in range(SAMPLES // 2):
        vol = rng.standard_normal((CHANNELS, SIDE, SIDE, SIDE), dtype=np.float32)
        np.save(os.path.join(vol_dir, f"sample_{i:04d}.npy"), vol)
    shard = os.path.join(pfs, "cosmo-val.tar.zst")
    with (
        open(shard, "wb") as raw,
        zstandard.ZstdCompressor(level=3).stream_writer(raw) as z,
        tarfile.open(fileobj=z, mode="w|") as tf,
    ):
        for i in range(SAMPLES // 2):
            path = os.path.join(pfs, f"val_{i:04d}.npy")
            np.save(path, rng.standard_normal((CHANNELS, SIDE, SIDE, SIDE), dtype=np.float32))
            tf.add(path, arcname=f"cosmo/val/sample_{i:04d}.npy")
            os.unlink(path)


def sh(*cmd: str) -> None:
    print(f"\n$ {' '.join(cmd)}", flush=True)
    rc = subprocess.run(cmd).returncode
    if rc != 0:
        sys.exit(f"demo: command failed with exit code {rc}")


def main() -> None:
    root = os.path.abspath(os.environ.get("DATASTORE_DEMO_DIR", "demo-data"))
    pfs, ssd = os.path.join(root, "pfs"), os.path.join(root, "ssd")
    shutil.rmtree(root, ignore_errors=True)
    generate(pfs)
    print(f"generated a dataset on the stand-in parallel filesystem {pfs}")
    ds = [sys.executable, "-m", "datastore"]
    srcs = [os.path.join(pfs, "cosmo"), os.path.join(pfs, "cosmo-val.tar.zst")]
    sh(*ds, "stage", *srcs, "--to", ssd, "--dry-run")
    sh(*ds, "stage", *srcs, "--to", ssd)
    sh(*ds, "stage", *srcs, "--to", ssd)  # a re-run skips what is unchanged
    sh(*ds, "stage", "--verify", "--to", ssd)
    found = shutil.which("mpiexec")
    mpiexec = mpiexec_command(found) if found else []  # Open MPI's: --oversubscribe
    shards = os.path.join(root, "node{node}")
    if mpiexec:
        sh(
            *mpiexec,
            "-n",
            "2",
            *ds,
            "stage",
            *srcs,
            "--to",
            shards,
            "--mode",
            "shard",
            "--ranks-per-node",
            "1",
        )
    train = os.path.join(ssd, "cosmo", "train.h5")
    sh(*ds, "inspect", train)
    read = [sys.executable, "-m", "mpi4py", "-m", "datastore.demo_read", train, "--epochs", "2"]
    sh(*read)
    if mpiexec:  # 2 data-parallel ranks x 2 spatial blocks, one-voxel halo
        sh(*mpiexec, "-n", "4", *read, "--parts", "2,1,1", "--halo", "1,1,1")
    if mpiexec:
        campaign(root)
    print(f"\ndemo done: staged copy in {ssd}, shards in {root}/node0 and {root}/node1")


def campaign(root: str) -> None:
    """``deploy/campaign-local.sh`` with ``deploy/demo.jobs``, then a summary of its logs."""
    deploy = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "deploy")
    work = os.path.join(root, "campaign")
    env = {**os.environ, "PYTHON": sys.executable, "XDG_STATE_HOME": os.path.join(root, "state")}
    cmd = ["bash", os.path.join(deploy, "campaign-local.sh"), "--jobs"]
    cmd += [os.path.join(deploy, "demo.jobs"), "--work", work]
    print(f"\n$ {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    rc = subprocess.run(cmd, env=env).returncode
    wall = time.perf_counter() - t0
    if rc != 0:
        sys.exit(f"demo: the campaign failed with exit code {rc} (logs in {work})")
    print(f"\ncampaign summary ({wall:.1f} s in all; logs in {work}/jobs):")
    for line in summarize(os.path.join(work, "jobs")):
        print(f"  {line}")


def summarize(jobs: str) -> list[str]:
    """One line per job of a campaign from its ``log.jsonl``: steps, last loss, samples/s,
    data-wait share and validation; the tournament's winner."""
    lines = []
    for name in sorted(os.listdir(jobs)):
        records = _records(os.path.join(jobs, name, "log.jsonl"))
        steps = [r for r in records if "step" in r and "loss" in r]
        val = [r for r in records if r.get("event") == "validation"]
        match = [r for r in records if r.get("event") == "tournament"]
        if match:
            t = match[-1]
            best = min(t["trainers"], key=lambda x: x["val_mse"])
            lines.append(
                f"{name}: {len(t['trainers'])} trainers, {t['steps']} steps, {t['rounds']} "
                f"rounds; best validation MSE {best['val_mse']:.4f} (lr {best['lr']:g}), "
                f"baseline {best['baseline_mse']:.4f}"
            )
        elif steps:
            rate = np.median([r["samples_per_s"] for r in steps[1:] or steps])
            wait = np.median([r["data_wait"] for r in steps[1:] or steps])
            vtext = f", validation MSE {val[-1]['val_mse']:.4f}" if val else ""
            lines.append(
                f"{name}: {steps[-1]['step']} steps, loss {steps[-1]['loss']:.4f}, "
                f"{rate:.1f} samples/s (median), data wait {wait:.1%}{vtext}"
            )
    return lines


def _records(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


if __name__ == "__main__":
    main()
