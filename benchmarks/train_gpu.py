"""Benchmark the trainer on a GPU (or, smaller, on the CPU): feeding, memory, exposed
communication.

What is measured
----------------
1. **Fed vs resident**: CosmoFlow (``--side``^3 x 4 channels, ``--width`` filters, 5 blocks;
   batch ``--batch``; on a GPU bf16 autocast, ``channels_last_3d``, ``cudnn.benchmark``), the
   full training step (forward, MSE, backward, ``SGD(momentum=0.9)``) fed by
   ``DataStoreLoader(train.h5, batch_size, fields=["x", "y"], device=<GPU>, pin_memory=True,
   prefetch=4)`` over a synthetic cosmology file (``trainer.cosmology``, ``--samples``
   samples, page cache warm), vs the same step on one batch resident on the device. ``--warmup``
   untimed steps, then ``--steps`` timed between two synchronizations; ``--reps`` reps in
   alternating order. Printed: samples/s (median and range) and fed / resident. Targets:
   >= 0.95x, and >= 185 samples/s per H100 (MLPerf HPC v3.0's best CosmoFlow, per GPU).
2. **Spatial split beats GPU memory** (``benchmarks/train_gpu_job.py`` under ``mpiexec``):
   CosmoFlow batch 1 at each side of ``--sides`` on one rank until one runs out of memory;
   that side then split 2 and 4 ways (``parts`` (2,1,1) and (4,1,1)), the ranks sharing the GPU
   over gloo, each with ``1/W`` of its memory. Peak memory per rank
   (``torch.cuda.max_memory_allocated``) whole vs split, at the largest side that fits whole.
   Targets: <= 0.6x at 2-way, <= 0.35x at 4-way. On the CPU the peak is the bytes autograd
   saves in one forward (``--cpu-side``), whole vs split.
3. **Exposed halo share** at a 2-way split (same job, ``--halo-side``): host seconds blocked in
   halo waits over the step, with ``DistConv3d(overlap=False)`` and ``overlap=True``.
4. **Exposed all-reduce share**, 2 data ranks (same job): seconds in
   ``GradientReducer.finish()`` over the step, with the buckets reduced after backward
   (``overlap=False``) and as backward produces them (``overlap=True``).

Jobs 2-4 run ranks sharing one GPU over gloo (messages staged through pinned host memory): a
single GPU cannot run NCCL between ranks; on a cluster each rank has its own GPU.

Usage::

    python benchmarks/train_gpu.py                  # on a GPU: the issue's sizes
    python benchmarks/train_gpu.py --device cpu     # small sizes, a few minutes on 2 cores
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from common import machine_info, median, spread, venv_tool

from datastore import DataStoreLoader
from trainer.cosmology import write_dataset
from trainer.models import CosmoFlow

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Step:
    """The training step of case 1 (module docstring)."""

    def __init__(self, side: int, width: int, device: torch.device) -> None:
        torch.manual_seed(0)
        self.device, self.gpu = device, device.type == "cuda"
        self.fmt = torch.channels_last_3d if self.gpu else torch.contiguous_format
        model = CosmoFlow(4, 3, input_size=side, conv_size=width, n_conv=5)
        self.model = model.to(device, memory_format=self.fmt)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4, momentum=0.9)
        torch.backends.cudnn.benchmark = True

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        x = x.to(self.device, non_blocking=True).contiguous(memory_format=self.fmt)
        y = y.to(self.device, non_blocking=True)
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.gpu):
            out = self.model(x)
        torch.nn.functional.mse_loss(out.float(), y).backward()
        self.opt.step()


def timed(step: Step, batches, warmup: int, steps: int, batch: int) -> float:
    """Samples per second of ``steps`` steps after ``warmup``."""
    it = iter(batches)
    for _ in range(warmup):
        b = next(it)
        step(b["x"], b["y"])
    sync(step.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        b = next(it)
        step(b["x"], b["y"])
    sync(step.device)
    return steps * batch / (time.perf_counter() - t0)


def forever(loader: DataStoreLoader):
    while True:
        yield from loader


def case_feed(a: argparse.Namespace, device: torch.device, path: str) -> None:
    print(f"\n1. fed vs resident: CosmoFlow {a.side}^3 x 4, width {a.width}, batch {a.batch}")
    step = Step(a.side, a.width, device)
    gpu = device.type == "cuda"
    results: dict[str, list[float]] = {"resident": [], "fed": []}
    for rep in range(a.reps):
        order = ["resident", "fed"] if rep % 2 == 0 else ["fed", "resident"]
        for name in order:
            if name == "resident":
                loader = DataStoreLoader(path, batch_size=a.batch, fields=["x", "y"])
                first = next(iter(loader))
                resident = {k: v.to(device).clone() for k, v in first.items()}
                loader.close()
                rate = timed(step, itertools.repeat(resident), a.warmup, a.steps, a.batch)
            else:
                kw = dict(device=device, pin_memory=True) if gpu else {}
                loader = DataStoreLoader(
                    path, batch_size=a.batch, fields=["x", "y"], prefetch=4, **kw
                )
                rate = timed(step, forever(loader), a.warmup, a.steps, a.batch)
                loader.close()
            results[name].append(rate)
    for name, rates in results.items():
        print(f"   {name:9s} {median(rates):8.1f} samples/s  (range {spread(rates, '{:.1f}')})")
    ratio = median(results["fed"]) / median(results["resident"])
    target = " (target >= 0.95x, >= 185 samples/s per H100)" if gpu else ""
    print(f"   fed / resident: {ratio:.3f}x{target}")


def job(a, n: int, side: int, parts: str, halo: bool, reduce: bool, device: str) -> dict:
    out = tempfile.mktemp(suffix=".json")
    script = [os.path.join(HERE, "train_gpu_job.py"), out, str(side), str(a.width), "1",
              str(a.job_steps), device, parts, str(int(halo)), str(int(reduce))]  # fmt: skip
    if n == 1:
        cmd = [sys.executable, *script]
    else:
        cmd = [venv_tool("mpiexec"), "-n", str(n), sys.executable, "-m", "mpi4py", *script]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, a.threads // n))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    for _ in range(3):  # gloo's teardown at exit aborts now and then (pytorch/pytorch#190489)
        proc = subprocess.run(cmd, env=env, timeout=600, capture_output=True, text=True)
        if proc.returncode == 0:
            break
    else:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout}{proc.stderr}")
    with open(out) as fh:
        result = json.load(fh)
    os.unlink(out)
    return result


def case_memory(a: argparse.Namespace, device: torch.device) -> None:
    dev = str(device)
    print("\n2. spatial split vs memory: CosmoFlow batch 1, peak per rank")
    if device.type != "cuda":
        side = a.cpu_side
        whole = job(a, 1, side, "1,1,1", False, True, dev)
    else:
        side, whole = None, None
        for s in a.sides:
            r = job(a, 1, s, "1,1,1", False, True, dev)
            fits = "" if r["oom"] else f"{r['peak_bytes'] / 2**30:.2f} GiB, "
            state = "out of memory" if r["oom"] else f"{fits}{r['step_s'] * 1e3:.0f} ms/step"
            print(f"   side {s}: {state}")
            if r["oom"]:
                break
            side, whole = s, r
        if side is None or whole is None:
            print("   the smallest side did not fit")
            return
        if s != side:  # the first side that does not fit whole, split
            for n in (2, 4):
                r = job(a, n, s, f"{n},1,1", False, True, dev)
                state = "out of memory" if r["oom"] else f"{r['peak_bytes'] / 2**30:.2f} GiB/rank"
                print(f"   side {s} split {n} ways: {state}")
    what = "GiB allocated" if device.type == "cuda" else "GiB saved by autograd"
    print(f"   side {side} whole: {whole['peak_bytes'] / 2**30:.3f} {what}")
    for n, target in ((2, 0.6), (4, 0.35)):
        for overlap in (False, True):
            r = job(a, n, side, f"{n},1,1", overlap, True, dev)
            how = f"split {n} ways, halo overlap {'on' if overlap else 'off'}"
            if r["oom"]:
                print(f"   {how}: out of memory")
                continue
            ratio = r["peak_bytes"] / whole["peak_bytes"]
            print(f"   {how}: {r['peak_bytes'] / 2**30:.3f} per rank = {ratio:.3f}x whole "
                  f"(target <= {target}x)")  # fmt: skip


def case_exposed(a: argparse.Namespace, device: torch.device) -> None:
    dev = str(device)
    side = a.halo_side
    print(f"\n3. exposed halo share, 2-way split, side {side}, batch 1 (host waits / step)")
    for overlap in (False, True):
        _exposed(a, "halo_share", overlap, lambda o: job(a, 2, side, "2,1,1", o, True, dev))
    print(f"\n4. exposed all-reduce share, 2 data ranks, side {side} (finish() / step)")
    for overlap in (False, True):
        _exposed(a, "reduce_share", overlap, lambda o: job(a, 2, side, "1,1,1", False, o, dev))


def _exposed(a: argparse.Namespace, key: str, overlap: bool, run: Any) -> None:
    """One row of cases 3 and 4: ``run(overlap)`` ``a.reps`` times, its ``key`` share."""
    shares, steps = [], []
    for _ in range(a.reps):
        r = run(overlap)
        shares.append(r[key])
        steps.append(r["step_s"] * 1e3)
    print(f"   overlap={overlap!s:5s}: {median(shares):.3f} (range {spread(shares, '{:.3f}')}),"
          f" step {median(steps):.0f} ms (range {spread(steps, '{:.0f}')})")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--side", type=int, default=None, help="case 1 cube side (GPU 128, CPU 32)")
    p.add_argument("--width", type=int, default=None, help="first filters (GPU 32, CPU 4)")
    p.add_argument("--batch", type=int, default=None, help="case 1 batch (GPU 8, CPU 4)")
    p.add_argument("--samples", type=int, default=None, help="case 1 samples (GPU 64, CPU 32)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (GPU 30, CPU 5)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--sides", type=int, nargs="+", default=[128, 192, 256, 320, 384, 448, 512])
    p.add_argument("--cpu-side", type=int, default=64, help="case 2 side on the CPU")
    p.add_argument("--halo-side", type=int, default=None, help="cases 3-4 side (GPU 128, CPU 64)")
    p.add_argument("--job-steps", type=int, default=None, help="steps per job (GPU 10, CPU 5)")
    p.add_argument("--cases", default="1234", help="which cases to run")
    p.add_argument("--dir", default=None, help="where the dataset goes (default: a temp dir)")
    a = p.parse_args()
    device = torch.device(a.device)
    gpu = device.type == "cuda"
    if gpu and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    for key, on_gpu, on_cpu in (("side", 128, 32), ("width", 32, 4), ("batch", 8, 4),
                                ("samples", 64, 32), ("steps", 30, 5), ("halo_side", 128, 64),
                                ("job_steps", 10, 5)):  # fmt: skip
        if getattr(a, key) is None:
            setattr(a, key, on_gpu if gpu else on_cpu)
    a.threads = os.cpu_count() or 1
    gpu_name = torch.cuda.get_device_name(device) if gpu else "no GPU"
    print(machine_info(f"torch {torch.__version__}", gpu_name))
    if "1" in a.cases:
        with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
            path = os.path.join(tmp, "train.h5")
            t0 = time.perf_counter()
            write_dataset(path, a.samples, a.side, seed=0)
            print(f"wrote {a.samples} samples of {a.side}^3 in {time.perf_counter() - t0:.0f} s")
            with open(path, "rb") as fh:  # warm the page cache
                while fh.read(1 << 24):
                    pass
            case_feed(a, device, path)
    if "2" in a.cases:
        case_memory(a, device)
    if "3" in a.cases or "4" in a.cases:
        case_exposed(a, device)


if __name__ == "__main__":
    main()
