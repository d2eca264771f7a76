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
   untimed steps, then ``--steps`` (GPU 20) timed between two synchronizations; ``--reps`` reps in
   alternating order. Printed: samples/s (median and range) and fed / resident. Targets:
   >= 0.95x, and >= 185 samples/s per H100 (MLPerf HPC v3.0's best CosmoFlow, per GPU).
2. **Spatial split beats GPU memory** (``benchmarks/train_gpu_job.py`` under ``mpiexec``):
   CosmoFlow batch 1 at each side of ``--sides`` (GPU default 128 192) on one rank until one
   runs out of memory; that side then split 2 and 4 ways (``parts`` (2,1,1) and (4,1,1)), the
   ranks sharing the GPU over gloo, each with ``1/W`` of its memory. Peak memory per rank
   (``torch.cuda.max_memory_allocated``) whole vs split (halo overlap ``--overlaps``, GPU
   default on), at the largest side that fits whole. Targets: <= 0.6x at 2-way, <= 0.35x at
   4-way. On the CPU the peak is the bytes autograd saves in one forward plus the parameters,
   gradients, optimizer state and gradient buckets a rank keeps (``--cpu-side``).
3. **Exposed halo** at a 2-way split (same job, ``--halo-side``), ``DistConv3d(overlap=False)``
   and ``overlap=True``, with ``trainer.comm.comm_clock``:
   - over NCCL (``--backend nccl``, the default with a GPU per rank: a cluster): the compute
     stream's stall in the halo waits, from CUDA events around each wait on that stream (the
     exposed halo: NCCL's waits return to the host at once, so host time says nothing), over
     the step's device time (CUDA events on the compute stream); and the halo transfers' time
     on NCCL's stream (NCCL's own CUDA events, ``TORCH_NCCL_ENABLE_TIMING=1``);
   - over gloo (one GPU, or the CPU): the host seconds blocked in the halo waits (host clock)
     over the step, and on a GPU the staged copies' device time (CUDA events).
4. **Exposed all-reduce**, 2 data ranks (same job): the buckets reduced after backward
   (``overlap=False``) and as backward produces them (``overlap=True``): the step's device
   time with the gradient all-reduce minus the same steps without it, the host seconds in
   ``GradientReducer.finish()``, and ``comm_clock`` as in 3.

On one GPU cases 2-4 run ranks sharing it over gloo (messages staged through pinned host
memory): NCCL refuses two ranks on one GPU. The NCCL path then runs at world 1: a rank cannot
be its own halo neighbour inside the model (the halo code has no periodic wrap), so a probe
job sends the first convolution's halo slab to itself with ``start_exchange``'s NCCL branch
and all-reduces the gradients on the 1-rank NCCL group, each started before a forward and
backward and waited after it, or waited at once: the stall and NCCL's time (there both are
local copies: the figures show the path and the clock work, not a network's cost).

Every case prints its elapsed time; a case whose job fails prints the job's output and the
next case still runs (exit status 1 at the end). The GPU defaults are sized for under about
two minutes in all with ``--reps 1`` on an H100 (an estimate: the first H100 run, with sides
to 384 and 64 samples, was cut off at 140 s in case 2).

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
from collections.abc import Callable
from math import nan

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


class JobFailed(RuntimeError):
    """A ``train_gpu_job.py`` run that wrote no result."""


def job(a: argparse.Namespace, n: int, side: int, parts: str, *flags: str) -> dict:
    """``train_gpu_job.py`` on ``n`` ranks (flags as its own); its JSON result. A run that
    wrote its result and then exited non-zero (gloo's teardown at exit aborts now and then,
    pytorch/pytorch#190489) counts; one that wrote none is tried once more, then raises
    :class:`JobFailed`."""
    out = tempfile.mktemp(suffix=".json")
    script = [os.path.join(HERE, "train_gpu_job.py"), out, "--side", str(side),
              "--width", str(a.width), "--steps", str(a.job_steps), "--device", a.job_device,
              "--parts", parts, *flags]  # fmt: skip
    if n == 1:
        cmd = [sys.executable, *script]
    else:
        cmd = [venv_tool("mpiexec"), "-n", str(n), sys.executable, "-m", "mpi4py", *script]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, a.threads // n))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    for _ in range(2):
        proc = subprocess.run(cmd, env=env, timeout=600, capture_output=True, text=True)
        result = written(out)
        if result is not None:
            if proc.returncode != 0:
                print(f"   (the job exited {proc.returncode} after writing its result)")
            return result
    raise JobFailed(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n"
                    f"{proc.stdout[-3000:]}{proc.stderr[-6000:]}")  # fmt: skip


def written(path: str) -> dict | None:
    """The JSON rank 0 wrote to ``path`` (removed), or ``None`` if there is none whole."""
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None
    finally:
        if os.path.exists(path):
            os.unlink(path)


def case_memory(a: argparse.Namespace, device: torch.device) -> None:
    print("\n2. spatial split vs memory: CosmoFlow batch 1, peak per rank")
    if device.type != "cuda":
        side = a.cpu_side
        whole = job(a, 1, side, "1,1,1", "--reduce-overlap")
    else:
        side, whole = None, None
        for s in a.sides:
            r = job(a, 1, s, "1,1,1", "--reduce-overlap")
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
                r = job(a, n, s, f"{n},1,1", "--halo-overlap", "--reduce-overlap")
                state = "out of memory" if r["oom"] else f"{r['peak_bytes'] / 2**30:.2f} GiB/rank"
                print(f"   side {s} split {n} ways: {state}")
    what = "GiB allocated" if device.type == "cuda" else "GiB saved by autograd and kept"
    print(f"   side {side} whole: {whole['peak_bytes'] / 2**30:.3f} {what}")
    for n, target in ((2, 0.6), (4, 0.35)):
        for overlap in a.overlaps:
            halo = ["--halo-overlap"] if overlap == "on" else []
            r = job(a, n, side, f"{n},1,1", *halo, "--reduce-overlap")
            how = f"split {n} ways, halo overlap {overlap}"
            if r["oom"]:
                print(f"   {how}: out of memory")
                continue
            ratio = r["peak_bytes"] / whole["peak_bytes"]
            print(f"   {how}: {r['peak_bytes'] / 2**30:.3f} per rank = {ratio:.3f}x whole "
                  f"(target <= {target}x)")  # fmt: skip


def figures(runs: list[dict], *what: tuple[str, Callable[[dict], float], str]) -> str:
    """``label median [range]`` of ``fn(run)`` over the runs, for each ``(label, fn, fmt)``."""
    out = []
    for label, fn, fmt in what:
        values = [fn(r) for r in runs]
        more = f" [{spread(values, fmt)}]" if len(values) > 1 else ""
        out.append(f"{label} {fmt.format(median(values))}{more}")
    return ", ".join(out)


def ms(key: str, kind: str | None = None) -> Callable[[dict], float]:
    """Milliseconds of ``run[key]`` or of ``run["comm"][kind][key]``."""
    if kind is None:
        return lambda r: r[key] * 1e3
    return lambda r: r["comm"][kind][key] * 1e3


def share(key: str, kind: str) -> Callable[[dict], float]:
    """``run["comm"][kind][key]`` over the step's device time."""
    return lambda r: r["comm"][kind][key] / r["step_device_s"]


def nccl_ms(kind: str) -> Callable[[dict], float]:
    """Milliseconds on NCCL's stream; nan where NCCL's timing gave none."""
    return lambda r: r["comm"][kind]["nccl_s"] * 1e3 if r["comm"][kind]["nccl_timed"] else nan


def copies(kind: str) -> Callable[[dict], float]:
    """Milliseconds of the staged copies (both ways, CUDA events)."""
    return lambda r: (r["comm"][kind]["to_host_s"] + r["comm"][kind]["to_device_s"]) * 1e3


def comm_figures(runs: list[dict], kind: str) -> str:
    """The exposed communication of ``kind``, in the terms of the runs' backend."""
    if runs[0]["backend"] == "nccl":
        return figures(runs, ("exposed (stream stall)", ms("stall_s", kind), "{:.2f} ms"),
                       ("share of the step", share("stall_s", kind), "{:.3f}"),
                       ("on NCCL's stream", nccl_ms(kind), "{:.2f} ms"))  # fmt: skip
    waits = figures(runs, ("exposed (host waits)", ms("host_wait_s", kind), "{:.2f} ms"),
                    ("share of the step", share("host_wait_s", kind), "{:.3f}"))  # fmt: skip
    if runs[0]["device"].startswith("cuda"):
        waits += ", " + figures(runs, ("staged copies (device)", copies(kind), "{:.2f} ms"))
    return waits


def how(backend: str, gpu: bool) -> str:
    if backend == "nccl":
        return ("NCCL, one GPU per rank. CUDA events: the step on the compute stream; that "
                "stream's stall in the waits = the exposed communication; the transfers on "
                "NCCL's stream (NCCL's events)")  # fmt: skip
    if gpu:
        return ("gloo, the ranks sharing one GPU (staged through pinned host memory). Host "
                "clock: the gloo waits; CUDA events: the step, the staged copies")  # fmt: skip
    return "gloo on the CPU. Host clock"


def case_exposed(a: argparse.Namespace, device: torch.device) -> None:
    gpu = device.type == "cuda"
    side, backend = a.halo_side, a.backend
    step = ("step", ms("step_device_s"), "{:.1f} ms")

    def runs(*flags: str) -> list[dict]:
        return [job(a, 2, side, *flags, "--backend", backend) for _ in range(a.reps)]

    print(f"\n3. exposed halo, 2-way split, side {side}, batch 1, over {how(backend, gpu)}")
    for overlap in (False, True):
        rs = runs("2,1,1", "--reduce-overlap", *(["--halo-overlap"] if overlap else []))
        print(f"   overlap={overlap!s:5s}: {figures(rs, step)}, {comm_figures(rs, 'exchange')}")
    print(f"\n4. exposed all-reduce, 2 data ranks, side {side}, over {how(backend, gpu)}")
    for overlap in (False, True):
        rs = runs("1,1,1", "--without-reduce", *(["--reduce-overlap"] if overlap else []))
        without = ("without the all-reduce", ms("step_device_without_reduce_s"), "{:.1f} ms")
        more = ("difference", lambda r: (r["step_device_s"] - r["step_device_without_reduce_s"])
                * 1e3, "{:.2f} ms")  # fmt: skip
        finish = ("in finish() (host)", ms("reduce_s"), "{:.2f} ms")
        print(f"   overlap={overlap!s:5s}: {figures(rs, step, without, more, finish)}, "
              f"{comm_figures(rs, 'all_reduce')}")  # fmt: skip
    if gpu and backend == "gloo":
        case_nccl_world1(a)


def case_nccl_world1(a: argparse.Namespace) -> None:
    """The NCCL path on one GPU: world 1 (NCCL refuses two ranks on one GPU)."""
    r = job(a, 1, a.halo_side, "1,1,1", "--backend", "nccl", "--probe")["probe"]
    fb = r["all_reduce"]["overlapped"]["compute_s"] * 1e3
    print(f"\n3-4 on NCCL at world 1 (one GPU: NCCL refuses two ranks on one GPU, and the halo "
          f"code has no periodic wrap, so no rank is its own neighbour): start_exchange's NCCL "
          f"branch (the first convolution's halo slab, {r['bytes']['exchange'] / 2**10:.0f} "
          f"KiB, sent to itself) and the gradients' all-reduce "
          f"({r['bytes']['all_reduce'] / 2**20:.1f} MiB), each around a forward and backward "
          f"of {fb:.1f} ms; CUDA events: the compute stream's stall, NCCL's stream")  # fmt: skip
    for op in ("exchange", "all_reduce"):
        for mode, t in r[op].items():
            print(f"   {op:10s} {mode:10s}: stall {t['stall_s'] * 1e3:.3f} ms, "
                  f"on NCCL's stream {t['nccl_s'] * 1e3:.3f} ms")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--side", type=int, default=None, help="case 1 cube side (GPU 128, CPU 32)")
    p.add_argument("--width", type=int, default=None, help="first filters (GPU 32, CPU 4)")
    p.add_argument("--batch", type=int, default=None, help="case 1 batch (GPU 8, CPU 4)")
    p.add_argument("--samples", type=int, default=32, help="case 1 samples")
    p.add_argument("--steps", type=int, default=None, help="timed steps (GPU 20, CPU 5)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--sides", type=int, nargs="+", default=[128, 192],
                   help="case 2 sides on a GPU, until one runs out of memory")  # fmt: skip
    p.add_argument("--overlaps", nargs="+", choices=("off", "on"), default=None,
                   help="case 2 splits' halo overlap (GPU on, CPU off on)")  # fmt: skip
    p.add_argument("--cpu-side", type=int, default=64, help="case 2 side on the CPU")
    p.add_argument("--halo-side", type=int, default=None, help="cases 3-4 side (GPU 128, CPU 64)")
    p.add_argument("--job-steps", type=int, default=None, help="steps per job (GPU 10, CPU 5)")
    p.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                   help="cases 3-4: auto is NCCL with a GPU per rank (2), else gloo")  # fmt: skip
    p.add_argument("--cases", default="1234", help="which cases to run")
    p.add_argument("--dir", default=None, help="where the dataset goes (default: a temp dir)")
    a = p.parse_args()
    device = torch.device(a.device)
    gpu = device.type == "cuda"
    if gpu and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    for key, on_gpu, on_cpu in (("side", 128, 32), ("width", 32, 4), ("batch", 8, 4),
                                ("steps", 20, 5), ("halo_side", 128, 64), ("job_steps", 10, 5),
                                ("overlaps", ["on"], ["off", "on"])):  # fmt: skip
        if getattr(a, key) is None:
            setattr(a, key, on_gpu if gpu else on_cpu)
    if a.backend == "auto":
        a.backend = "nccl" if gpu and torch.cuda.device_count() >= 2 else "gloo"
    a.job_device = str(device)
    a.threads = os.cpu_count() or 1
    gpu_name = torch.cuda.get_device_name(device) if gpu else "no GPU"
    print(machine_info(f"torch {torch.__version__}", gpu_name))
    start = time.perf_counter()
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
        elapsed("1", start)
    failed = []
    for cases, run in (("2", case_memory), ("34", case_exposed)):
        if any(c in a.cases for c in cases):
            t0 = time.perf_counter()
            try:
                run(a, device)
            except JobFailed as e:  # the next case still runs
                failed.append("-".join(cases))
                print(f"   case {failed[-1]} failed: {e}", flush=True)
            elapsed("-".join(cases), t0)
    print(f"\nall cases: {time.perf_counter() - start:.0f} s")
    if failed:
        sys.exit(f"failed: case {', '.join(failed)}")


def elapsed(case: str, t0: float) -> None:
    print(f"   (case {case}: {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
