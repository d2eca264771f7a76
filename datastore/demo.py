"""``make demo``: generate a small dataset on a stand-in parallel filesystem, stage it, read it.

Writes under ``./demo-data`` (``DATASTORE_DEMO_DIR`` overrides): ``pfs/`` plays the parallel
filesystem (CosmoFlow-like volumes and labels in one HDF5 file, a tree of ``.npy`` volumes, and
a ``.tar.zst`` shard of more volumes), ``ssd/`` plays node-local storage. The staged HDF5 is
then read through ``DataStoreLoader``: one rank, then four MPI ranks as a 2 x 2 data x spatial
grid, each receiving only its half of every volume plus a one-voxel halo. Last, ``datastore
serve`` keeps the staged dataset resident while two jobs stream from it at once, ``datastore
status`` shows both, and SIGTERM shuts the service down cleanly. Finally the trainer: a small
synthetic cosmology dataset (``trainer.cosmology``), and ``python -m trainer train`` on four MPI
ranks as a 2 x 2 data x spatial grid, fed by a ``datastore serve``, printing the loss,
samples/s and the data-wait share.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time

import h5py
import numpy as np
import zstandard

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
    mpiexec = shutil.which("mpiexec")
    shards = os.path.join(root, "node{node}")
    if mpiexec:
        sh(
            mpiexec,
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
        sh(mpiexec, "-n", "4", *read, "--parts", "2,1,1", "--halo", "1,1,1")
    serve_two_jobs(root, train)
    if mpiexec:
        train_on_grid(root, mpiexec)
    print(f"\ndemo done: staged copy in {ssd}, shards in {root}/node0 and {root}/node1")


def serve_two_jobs(root: str, train: str) -> None:
    """Start the service, run two jobs on it at once, show its status, stop it with SIGTERM."""
    ds = [sys.executable, "-m", "datastore"]
    sock = os.path.join(root, "run", "datastore.sock")
    service = start_service(root, sock)
    read = [sys.executable, "-m", "datastore.demo_read", train, "--address", sock]
    read += ["--step-ms", "400"]  # a trainer's compute step: the jobs overlap
    jobs = [[*read, "--job", "job-a", "--epochs", "3"], [*read, "--job", "job-b", "--epochs", "2"]]
    for job in jobs:
        print(f"$ {' '.join(job)} &", flush=True)
    running = [subprocess.Popen(job) for job in jobs]
    time.sleep(2.0)
    sh(*ds, "status", "--socket", sock)
    if any(p.wait(120) != 0 for p in running):
        service.kill()
        sys.exit("demo: a job reading from the service failed")
    sh(*ds, "status", "--socket", sock)
    stop_service(service, sock)


def start_service(root: str, sock: str) -> subprocess.Popen:
    """``datastore serve`` on ``sock``, once its socket exists."""
    env = {**os.environ, "XDG_STATE_HOME": os.path.join(root, "state")}
    cmd = [sys.executable, "-m", "datastore", "serve", "--socket", sock, "--memory-budget", "1G"]
    print(f"\n$ {' '.join(cmd)} &", flush=True)
    service = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not os.path.exists(sock):
        if service.poll() is not None or time.monotonic() > deadline:
            sys.exit("demo: datastore serve did not start")
        time.sleep(0.1)
    return service


def stop_service(service: subprocess.Popen, sock: str) -> None:
    """SIGTERM, and check that the service exits 0 and removes its socket."""
    print(f"\n$ kill -TERM {service.pid}", flush=True)
    service.send_signal(signal.SIGTERM)
    rc = service.wait(30)
    print(f"datastore serve exited {rc}; socket removed: {not os.path.exists(sock)}", flush=True)
    if rc != 0:
        sys.exit(f"demo: datastore serve exited {rc}")


def train_on_grid(root: str, mpiexec: str) -> None:
    """Train CosmoFlow on a 2 x 2 data x spatial grid of MPI ranks, fed by ``datastore serve``."""
    data = os.path.join(root, "cosmo-train")
    sh(sys.executable, "-m", "trainer.cosmology", data, "--samples", "64", "--val-samples", "16",
       "--size", "16", "--seed", "0")  # fmt: skip
    sock = os.path.join(root, "run", "train.sock")
    service = start_service(root, sock)
    sets = [
        f"data={data}", "spatial_parts=[2,1,1]", "width=4", "conv_blocks=3", "global_batch=8",
        "epochs=2", "warmup=4", "print_every=2", f"data_address={sock}",
    ]  # fmt: skip
    train = [mpiexec, "-n", "4", sys.executable, "-m", "mpi4py", "-m", "trainer", "train"]
    try:
        sh(*train, *[a for s in sets for a in ("--set", s)])
    finally:
        if service.poll() is None:
            stop_service(service, sock)


if __name__ == "__main__":
    main()
