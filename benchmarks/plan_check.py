"""Check ``datastore plan``'s predictions against real runs on this machine, at small scale.

What is done
------------
1. **The machine, measured** (what ``datastore plan`` is then given):

   - "parallel filesystem" read: the source files read once more in 1 MiB reads, as staging
     finds them (the page cache cannot be dropped here without root: warm);
   - "NVMe" write: 256 MiB written and ``fdatasync``-ed next to the destinations by one writer
     (one node), and by two at once (each of two "nodes" sharing this one disk); the median of
     3 tries each (this disk's rate moves by tens of percent from one to the next);
   - "network": MPI point-to-point between two processes (``mpiexec -n 2``), 64 MiB messages
     both ways.

2. **The model**: ``datastore plan SRC --json`` with those figures, for 1 node and for 2 nodes
   of 1 rank each, global batch ``2 B``, step ``--step-time``; once with the link alone
   (``--network-bw``), once with ``--exchange-bw``, the store's own exchange rate calibrated
   on a separate job at ``--calibrate-batch`` samples a rank (half of ``B`` by default): the
   bytes it exchanged per step over the time they added to its step.

3. **Real runs** on a dataset of ``--samples`` ``.npy`` files, float32 (4, S, S, S), written by
   ``benchmarks/peers.py``'s generator:

   - staging: ``datastore stage SRC --to DEST`` (replicate, 1 node), then
     ``mpiexec -n 2 datastore stage SRC --to DEST/node{node} --ranks-per-node 1`` replicated
     and ``--mode shard``, as ``tests/test_stage_mpi.py`` runs them; the time is the stage's
     own (``--json``'s ``seconds``: planning, copying, the final ``syncfs``; the interpreter's
     and MPI's start-up left out, as the model leaves them out);
   - resident bytes: ``mpiexec -n 2 python -m mpi4py -m datastore serve`` over the replicated
     copies, then over the sharded ones (``benchmarks/peers.py``'s ``Store``); after a job, each
     service's ``datastore status --json`` (``datasets[].bytes_resident``);
   - exchange: on each store one job of two client processes (rank k on service k, no compute,
     ``benchmarks/peers.py``'s clients): the bytes each rank receives from the other node per
     step (``bytes_exchanged`` of the services, as ``peers.py`` counts it), and the time per
     step. The exchange's cost per step is the sharded store's step time less the replicated
     one's (same job, same batches, only the exchange differs); its share of a step is that
     over ``--step-time``, as the model's.

4. **Printed**: predicted vs measured and the relative error (predicted / measured - 1).

Usage::

    python benchmarks/plan_check.py              # about 25 s on 2 cores
    python benchmarks/plan_check.py --samples 48 --side 48 --out /tmp/plan_check.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from common import key_ratio, machine_info, median, venv_tool, write_results
from peers import Job, Store, clean_env, ensure_data, run_jobs

from datastore.store.memory import available_memory

MIB = 1 << 20
PROBE_BYTES = 256 * MIB
MPI_BW = """
import time
import numpy as np
from mpi4py import MPI
comm = MPI.COMM_WORLD
buf = np.ones(64 << 20, np.uint8)
peer = 1 - comm.rank
best = []
for _ in range(6):
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(4):
        if comm.rank == 0:
            comm.Send(buf, dest=peer); comm.Recv(buf, source=peer)
        else:
            comm.Recv(buf, source=peer); comm.Send(buf, dest=peer)
    best.append(8 * buf.nbytes / (time.perf_counter() - t0))
if comm.rank == 0:
    print(sorted(best)[len(best) // 2])
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="./bench-data/plan", help="where data and copies go")
    p.add_argument("--samples", type=int, default=96, help="samples (default 96)")
    p.add_argument("--side", type=int, default=64, help="a sample is (4,S,S,S) float32")
    p.add_argument("--batch", type=int, default=4, help="samples per rank per step")
    p.add_argument("--epochs", type=int, default=8, help="timed epochs of each job")
    p.add_argument("--step-time", type=float, default=0.1, help="the step the shares are of")
    p.add_argument(
        "--calibrate-batch", type=int, default=None,
        help="samples per rank of the job that measures --exchange-bw (default: batch / 2)",
    )  # fmt: skip
    p.add_argument(
        "--out",
        "--json",
        default=None,
        metavar="FILE",
        help="also write the results as JSON (benchmarks/report.py reads it)",
    )
    args = p.parse_args(argv)
    args.calibrate_batch = args.calibrate_batch or max(1, args.batch // 2)
    for flag, b in (("--batch", args.batch), ("--calibrate-batch", args.calibrate_batch)):
        if args.samples < 4 * b or args.samples % (2 * b):
            p.error(f"--samples must be a multiple of 2 x {flag}, and at least 4 x {flag}")
    return args


# ----------------------------------------------------------------------------- the machine


def read_bw(src: str) -> float:
    """Bytes/s reading every file of ``src`` in 1 MiB reads."""
    total, t0 = 0, time.perf_counter()
    for name in sorted(os.listdir(src)):
        with open(os.path.join(src, name), "rb", buffering=0) as f:
            while chunk := f.read(MIB):
                total += len(chunk)
    return total / (time.perf_counter() - t0)


def write_bw(where: str, writers: int) -> float:
    """Bytes/s of each of ``writers`` threads writing ``PROBE_BYTES`` and ``fdatasync``-ing it
    at once (the median writer)."""
    block = os.urandom(MIB)
    rates: list[float] = []

    def one(k: int) -> None:
        path = os.path.join(where, f".probe{k}")
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for _ in range(PROBE_BYTES // MIB):
                os.write(fd, block)
            os.fdatasync(fd)
        finally:
            os.close(fd)
            os.unlink(path)
        rates.append(PROBE_BYTES / (time.perf_counter() - t0))

    threads = [threading.Thread(target=one, args=(k,)) for k in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return median(rates)


def mpi_bw(env: dict[str, str]) -> float:
    cmd = [venv_tool("mpiexec"), "-n", "2", sys.executable, "-m", "mpi4py", "-c", MPI_BW]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        sys.exit(f"the MPI bandwidth probe failed:\n{r.stderr}")
    return float(r.stdout.split()[-1])


def stage(src: str, dest: str, nodes: int, mode: str, env: dict[str, str]) -> float:
    """The seconds ``datastore stage SRC --to DEST`` reports (under ``mpiexec -n nodes``, one
    rank a node, DEST a ``{node}`` template, when ``nodes > 1``)."""
    cmd = [sys.executable, "-m", "datastore", "stage", src, "--to", dest, "--mode", mode]
    cmd += ["--json"]
    if nodes > 1:
        cmd = [venv_tool("mpiexec"), "-n", str(nodes), *cmd, "--ranks-per-node", "1"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout}{r.stderr}")
    return float(json.loads(r.stdout.strip().splitlines()[-1])["seconds"])


# ----------------------------------------------------------------------------- the model


def predict(
    src: str, nodes: int, bw: dict[str, float], args: argparse.Namespace, exchange: bool = False
) -> dict:
    """``datastore plan SRC --json`` for ``nodes`` nodes of one rank on the measured machine
    (``exchange``: with the store's calibrated exchange rate too)."""
    free = shutil.disk_usage(args.work).free
    cmd = [sys.executable, "-m", "datastore", "plan", src, "--json"]
    cmd += ["--nodes", str(nodes), "--ranks-per-node", "1", "--gpus-per-node", "0"]
    cmd += ["--memory-per-node", str((available_memory() or 1 << 34) // nodes)]
    cmd += ["--nvme-per-node", str(free // nodes), "--pfs-read-bw", str(bw["pfs"])]
    cmd += ["--nvme-write-bw", str(bw["write1" if nodes == 1 else "write2"])]
    cmd += ["--network-bw", str(bw["network"]), "--global-batch", str(nodes * args.batch)]
    cmd += ["--step-time", str(args.step_time)]
    if exchange:
        cmd += ["--exchange-bw", str(bw["exchange"])]
    r = subprocess.run(cmd, env=args.env, capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        sys.exit(f"datastore plan failed ({r.returncode}): {r.stderr}")
    return json.loads(r.stdout)


def row(plan: dict, staging: str, shuffle: str = "global") -> dict:
    return next(r for r in plan["layouts"] if (r["staging"], r["shuffle"]) == (staging, shuffle))


def staging_of(plan: dict, mode: str) -> dict:
    return next(s for s in plan["staging"] if s["mode"] == mode)


# ----------------------------------------------------------------------------- the stores


def status_json(socket: str, env: dict[str, str]) -> dict:
    cmd = [sys.executable, "-m", "datastore", "status", "--socket", socket, "--json"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        sys.exit(f"datastore status failed: {r.stderr}")
    return json.loads(r.stdout)


def run_store(template: str, src: str, args: argparse.Namespace, batch: int) -> dict[str, Any]:
    """One 2-service store over ``template``: a job of 2 ranks taking ``batch`` samples each a
    step, then each service's resident bytes; per-step time and exchanged bytes per rank per
    step."""
    store = Store("mpi", template, src)
    job = Job("mpi", "whole")
    peer_args = argparse.Namespace(
        samples=args.samples, batch=batch, epochs=args.epochs, layouts=["whole"]
    )
    try:
        run_jobs(store, peer_args, {("mpi", "whole"): job})
        resident = [
            sum(int(d["bytes_resident"]) for d in status_json(s, store.env)["datasets"])
            for s in store.sockets
        ]
    finally:
        left = store.stop()
    if left:
        sys.exit(f"left behind by the services: {left}")
    steps = job.batches[0] / 2  # both ranks take every step
    return {
        "step_s": job.seconds[0] / steps,
        "exchange_bytes": job.exchanged[0] / (2 * steps),
        "resident": resident,
    }


# ----------------------------------------------------------------------------- the report


def calibrated_rate(nbytes: float, added_s: float) -> float | None:
    """The store's exchange rate: the ``nbytes`` a rank exchanged per step over the
    ``added_s`` seconds they added to the step; ``None`` where they added none (the sharded job
    was no slower than the replicated one: noise), not a rate over a floor of 1 us."""
    return nbytes / added_s if added_s > 0 else None


def err(pred: float, meas: float) -> str:
    if meas == 0:
        return "exact" if pred == 0 else "-"
    return f"{pred / meas - 1:+.1%}"


SCALE = {"s": 1.0, "MiB": 1 / 2**20, "ms": 1e3, "%": 100.0}  # stored value -> shown unit


def fmt(v: float, unit: str) -> str:
    shown = v * SCALE[unit]
    return f"{shown:.2f} s" if unit == "s" else f"{shown:.1f}{'' if unit == '%' else ' '}{unit}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    args.work = work = os.path.abspath(args.dir)
    os.makedirs(work, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="datastore-plan-check-", dir=work)
    args.env = env = clean_env(tmp)
    copies = {k: os.path.join(work, k) for k in ("rep1", "rep2", "shard2")}
    try:
        src = ensure_data(work, args.samples, args.side)
        print("measuring the machine ...", flush=True)
        bw = {
            "pfs": read_bw(src),
            "write1": median([write_bw(work, 1) for _ in range(3)]),
            "write2": median([write_bw(work, 2) for _ in range(3)]),
            "network": mpi_bw(env),
        }
        print("staging ...", flush=True)
        for path in copies.values():
            shutil.rmtree(path, ignore_errors=True)
        staged = {
            "rep1": stage(src, copies["rep1"], 1, "replicate", env),
            "rep2": stage(src, copies["rep2"] + "/node{node}", 2, "replicate", env),
            "shard2": stage(src, copies["shard2"] + "/node{node}", 2, "shard", env),
        }
        print("serving ...", flush=True)
        served, calibration = {}, {}
        for k in ("rep2", "shard2"):
            template = os.path.join(copies[k], "node{node}", "src")
            calibration[k] = run_store(template, src, args, args.calibrate_batch)
            served[k] = run_store(template, src, args, args.batch)
        added = calibration["shard2"]["step_s"] - calibration["rep2"]["step_s"]
        bw["exchange"] = calibrated_rate(calibration["shard2"]["exchange_bytes"], added)
        print("predicting ...", flush=True)
        one, two = predict(src, 1, bw, args), predict(src, 2, bw, args)
        two_cal = predict(src, 2, bw, args, exchange=True) if bw["exchange"] else None
    finally:
        for path in [tmp, *copies.values()]:
            shutil.rmtree(path, ignore_errors=True)

    extra = served["shard2"]["step_s"] - served["rep2"]["step_s"]
    cases = (("replicate, 1 node", one, "rep1"), ("replicate, 2 nodes", two, "rep2"),
             ("shard, 2 nodes", two, "shard2"))  # fmt: skip
    rows = [
        (f"staging, {name}", staging_of(plan, name.split(",")[0])["seconds"], staged[k], "s")
        for name, plan, k in cases
    ]
    for k, mode in (("rep2", "replicate"), ("shard2", "shard")):
        pred = row(two, mode)["resident_bytes"]
        for node, got in enumerate(served[k]["resident"]):
            rows.append((f"resident, {mode}, node {node}", pred, got, "MiB"))
    for k, mode in (("rep2", "replicate"), ("shard2", "shard")):
        pred = row(two, mode)["exchange_bytes"]
        rows.append((f"exchange/rank/step, {mode}", pred, served[k]["exchange_bytes"], "MiB"))
    share = extra / args.step_time
    for plan, how in ((two, "link"), (two_cal, "calibrated exchange_bw")):
        if plan is None:
            continue
        shard_row = row(plan, "shard")
        rows.append((f"exchange time/step, shard ({how})", shard_row["exchange_s"], extra, "ms"))
        rows.append((f"exchange share, shard ({how})", shard_row["exchange_share"], share, "%"))

    mb = 16 * args.side**3 / MIB
    lines = [
        f"plan_check: {args.samples} samples x {mb:.1f} MiB (.npy, float32 (4, {args.side}, "
        f"{args.side}, {args.side})); 2 'nodes' = 2 processes on this host; batch "
        f"{args.batch} a rank, step {args.step_time} s",
        f"measured: read {bw['pfs'] / 1e9:.2f} GB/s (page cache, warm), write "
        f"{bw['write1'] / 1e9:.2f} GB/s (1 writer) / {bw['write2'] / 1e9:.2f} GB/s each (2), "
        f"MPI {bw['network'] / 1e9:.2f} GB/s; staging times are the stages' own (--json)",
        "",
        "| quantity | predicted | measured | error |",
        "|---|---:|---:|---:|",
        *(f"| {n} | {fmt(p, u)} | {fmt(m, u)} | {err(p, m)} |" for n, p, m, u in rows),
        "",
        f"step time of the job (no compute): replicated {served['rep2']['step_s'] * 1e3:.1f} ms, "
        f"sharded {served['shard2']['step_s'] * 1e3:.1f} ms; the store's exchange rate "
        f"calibrated at batch {args.calibrate_batch} (given as --exchange-bw): "
        + (
            f"{bw['exchange'] / 1e9:.2f} GB/s"
            if bw["exchange"]
            else f"not measured (the sharded job was no slower: {added * 1e3:+.1f} ms a step)"
        ),
        f"recommended for 2 nodes: {two['recommended']['staging']}, "
        f"shuffle={two['recommended']['shuffle']!r}",
        "machine: " + machine_info(),
        f"(wall time {time.monotonic() - t_start:.0f} s)",
    ]
    print("\n" + "\n".join(lines))
    if args.out:
        ratios = [
            key_ratio(f"plan: {n}", ours=p * SCALE[u], peer=m * SCALE[u], unit=u,
                      ratio=p / m if m else None, of="predicted / measured")
            for n, p, m, u in rows
        ]  # fmt: skip
        doc = {
            "bandwidths": bw,
            "rows": [
                {"quantity": n, "predicted": p, "measured": m, "unit": u} for n, p, m, u in rows
            ],
            "served": served,
            "plan_1_node": one,
            "plan_2_nodes": two,
        }
        write_results(args.out, "plan_check", doc, ratios)
    return 0


if __name__ == "__main__":
    sys.exit(main())
