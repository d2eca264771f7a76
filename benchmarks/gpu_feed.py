"""Benchmark how well each input pipeline keeps one GPU fed: CosmoFlow training steps.

What is measured
----------------
One HDF5 file written with h5py under ``--dir`` (default: a new temporary directory, removed at
the end; a given directory is kept and its data reused): ``--samples`` N (default 96) samples of
``x`` float32 (4, S, S, S), S = ``--size`` (default 128: 32 MiB a sample), one chunk per sample,
and ``y`` float32 (4,) in [-1, 1]. The file is read through once before anything is timed, so
the page cache is warm.

The model is ``trainer.models.CosmoFlow(4, 4, input_size=S)`` at its default width
(``conv_size`` 32, 5 blocks; ``--width`` changes it) in ``channels_last_3d`` memory format. One
step: the input to ``channels_last_3d``, forward under ``torch.autocast(dtype=bfloat16)``, MSE
loss, backward, ``SGD(momentum=0.9).step()``; ``cudnn.benchmark`` on. Batch ``--batch`` B
(default 8). On one GPU, in one run:

a. **ceiling**: one batch resident on the GPU, every step: the model's steps alone.
b. **embedded**: ``DataStoreLoader(path, batch_size=B, device="cuda", pin_memory=True,
   prefetch=4)``.
c. **service, shared memory**: one ``datastore serve`` subprocess (the dataset resident first,
   ``LoadDataset(wait=True)``); ``DataStoreLoader(path, batch_size=B,
   service=ServiceOptions(SOCKET, transport="shm"), device="cuda", pin_memory=True, prefetch=4)``.
d. **service, TCP inline**: the same service, also on ``--tcp 127.0.0.1:PORT`` with a token
   file; ``DataStoreLoader(path, batch_size=B, service=ServiceOptions("127.0.0.1:PORT",
   token=TOKEN, transport="inline"), device="cuda", pin_memory=True, prefetch=4)``.
e. **torch DataLoader over h5py**, for each ``num_workers`` W of ``--workers`` (default 4, 8,
   16): ``DataLoader(ds, batch_size=B, shuffle=True, drop_last=True, num_workers=W,
   persistent_workers=True, pin_memory=True)`` over a map-style Dataset that opens the HDF5
   file lazily in each worker (``loader.H5Samples``); batches moved with ``.to(device,
   non_blocking=True)``.

Each case, each rep: a fresh loader, ``--warmup`` untimed steps, then ``--steps`` timed steps
between two ``torch.cuda.synchronize()``; samples/s = samples stepped / seconds. ``--reps``
reps (default 3), the order of the cases reversed every other rep. Printed: the median, the
full range, and the ratio of the medians to (a). Targets: (b) >= 0.95x, (c) >= 0.90x; (d) and
the best (e) are reported.

The machine's limits, in the same run: memcpy into pinned memory by thread count (for each N
of ``--threads``, default 1, 2, 4, ... up to the cores: N threads each copying a disjoint slice
of a batch-sized array into a preallocated page-locked buffer with ``numpy.copyto``,
``--copies`` times), and the host -> device copy of one batch from pinned and from pageable
memory.

The CPU half, which runs with or without CUDA: **gather GB/s into the loader's batch buffers vs
the memcpy ceiling by thread count**. For each N of ``--threads``: the memcpy figure above
(into pinned memory with CUDA, else pageable) and ``DataStoreLoader(path, batch_size=B,
threads=N, pin_memory=<CUDA>, prefetch=4)`` delivering host batches: one untimed epoch, then
``--epochs`` (default 2) timed epochs, each batch consumed trivially (one element of each field
read); GB/s = bytes of the batches (every field) / seconds. Ratio loader / memcpy at the same
N; target >= 0.8x.

Without CUDA the GPU cases and the host -> device copies are skipped, and the output says so;
``--device cpu`` runs (a)-(e) on the CPU instead: a smoke test of their code, whose figures say
nothing about feeding a GPU. ``--host-step MS`` replaces the model by MS ms of Python on the
consumer's thread per step, holding the GIL as a GPU trainer's thread does while it launches
kernels (the GPU's work is asynchronous): with ``--device cpu`` and a small ``--size``, (a)-(d)
then time the feeds themselves against a step of known length on a CPU (e.g. the service's
shared memory vs the embedded loader: ``--device cpu --host-step 8 --size 64 --samples 48
--cases a,b,c``). Cases that need ``DataStoreLoader``'s ``device=`` or ``threads=``
(issue 11) fail with a message saying so while the installed ``datastore`` lacks them; the
other cases still run. The exit status is 1 when any case failed. GB/s are 10^9 bytes/s.

Usage::

    python benchmarks/gpu_feed.py                          # full run, on a GPU
    python benchmarks/gpu_feed.py --quick                  # smoke run: S=32, few steps
    python benchmarks/gpu_feed.py --cases limits,gather    # the CPU half only
    python benchmarks/gpu_feed.py --device cpu --host-step 8 --size 64 --samples 48 --cases a,b,c
    python benchmarks/gpu_feed.py --json /tmp/feed.json --dir /scratch/feed --reps 5
    python benchmarks/gpu_feed.py --json benchmarks/results/gpu_feed.json  # for report.py
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import h5py
import numpy as np
import torch
from common import (
    Service,
    cores,
    key_ratio,
    machine_info,
    median,
    memcpy_gbps,
    parse_counts,
    spread,
    stats,
    verdict,
    write_results,
)
from loader import H5Samples
from torch.utils.data import DataLoader

MIB, GIB = 1 << 20, 1 << 30
CHANNELS, OUTPUTS = 4, 4
N_CONV = 5  # CosmoFlow's default blocks: the side must divide by 2**5
FEEDS = ("a", "b", "c", "d", "e")
CASES = (*FEEDS, "limits", "gather")
TITLES = {
    "a": "(a) ceiling: the batch resident on the device",
    "b": "(b) embedded DataStoreLoader",
    "c": "(c) datastore serve, shared memory",
    "d": "(d) datastore serve, TCP inline",
    "e": "(e) torch DataLoader over h5py",
}
TARGETS = {"b": 0.95, "c": 0.90}
GATHER_TARGET = 0.8
LAYOUT_VERSION = 1

__all__ = ["main"]


# ----------------------------------------------------------------------------- arguments


def default_threads() -> list[int]:
    c = cores()
    return sorted({2**i for i in range(c.bit_length()) if 2**i <= c} | {c})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=None, help="where the data is written (default: a temp dir)")
    p.add_argument("--samples", type=int, default=None, help="samples N (default 96; 32 quick)")
    p.add_argument("--size", type=int, default=None, help="x is (4,S,S,S) (default 128; 32 quick)")
    p.add_argument("--batch", type=int, default=8, help="batch B (default 8)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 40; 4 quick)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 8)")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 3; 1 quick)")
    p.add_argument("--epochs", type=int, default=2, help="timed epochs of the gather (default 2)")
    p.add_argument("--width", type=int, default=None, help="CosmoFlow conv_size (default: its own)")
    p.add_argument("--prefetch", type=int, default=4, help="our loaders' prefetch (default 4)")
    p.add_argument("--workers", default="4,8,16", help="DataLoader num_workers to try for (e)")
    p.add_argument("--threads", default="auto", help="thread counts (default 1, 2, 4.. cores)")
    p.add_argument("--copies", type=int, default=10, help="memcpy / host-device copies timed")
    p.add_argument("--cases", default=",".join(CASES), help="cases, comma separated")
    p.add_argument(
        "--device", default=None, help="where the model runs (default: cuda when available)"
    )
    p.add_argument(
        "--host-step", type=float, default=None, metavar="MS",
        help="a step is MS ms of Python holding the GIL instead of the model (feeds on a CPU)",
    )  # fmt: skip
    p.add_argument("--quick", action="store_true", help="smoke run: S=32, N=32, 4 steps, 1 rep")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    args = p.parse_args(argv)
    quick = args.quick
    for name, full, small in (
        ("samples", 96, 32), ("size", 128, 32), ("steps", 40, 4), ("warmup", 8, 2), ("reps", 3, 1),
    ):  # fmt: skip
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    args.workers = parse_counts(args.workers, [], "--workers")
    args.threads = parse_counts(args.threads, default_threads(), "--threads")
    args.cases = [c for c in CASES if c in {v.strip() for v in args.cases.split(",")}]
    if not args.cases:
        p.error(f"--cases: pick from {','.join(CASES)}")
    if args.size % 2**N_CONV:
        p.error(f"--size must be a multiple of {2**N_CONV} (CosmoFlow's {N_CONV} poolings)")
    if min(args.batch, args.steps, args.reps, args.epochs, args.prefetch, args.copies) < 1:
        p.error("--batch, --steps, --reps, --epochs, --prefetch and --copies must be >= 1")
    if args.warmup < 1 or min(args.workers, default=1) < 1 or min(args.threads) < 1:
        p.error("--warmup, --workers and --threads must be >= 1")
    if args.samples < args.batch:
        p.error("--samples must hold at least one batch")
    if args.host_step is not None and not args.host_step > 0:
        p.error("--host-step must be > 0 ms")
    return args


# ----------------------------------------------------------------------------- the dataset


def sample_bytes(size: int) -> int:
    return CHANNELS * size**3 * 4 + OUTPUTS * 4


def ensure_data(work: str, n: int, size: int) -> str:
    """Write ``samples.h5`` (``x`` (n, 4, S, S, S), ``y`` (n, 4), float32) unless it is there."""
    path = os.path.join(work, "samples.h5")
    stamp = os.path.join(work, "data.json")
    want = {"samples": n, "size": size, "layout": LAYOUT_VERSION}
    with contextlib.suppress(OSError, ValueError), open(stamp) as f:
        if json.load(f) == want and os.path.exists(path):
            return path
    need = n * sample_bytes(size) + 64 * MIB
    if shutil.disk_usage(work).free < need:
        sys.exit(f"{work}: not enough free disk for {need / GIB:.1f} GiB of data")
    print(f"generating {n} samples x {sample_bytes(size) / MIB:.1f} MiB under {work} ...")
    with contextlib.suppress(FileNotFoundError):
        os.remove(stamp)
    shape = (CHANNELS, size, size, size)
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        x = f.create_dataset("x", (n, *shape), "f4", chunks=(1, *shape))
        f.create_dataset("y", data=rng.random((n, OUTPUTS), dtype=np.float32) * 2 - 1)
        buf = np.empty(shape, np.float32)
        for i in range(n):
            rng.random(shape, dtype=np.float32, out=buf)
            x[i] = buf
    with open(stamp, "w") as f:
        json.dump(want, f)
    return path


def warm_cache(path: str) -> float:
    """Read ``path`` through once (the page cache is warm after); the seconds it took."""
    t0 = time.perf_counter()
    buf = bytearray(16 * MIB)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------- the model


class Trainer:
    """CosmoFlow in ``channels_last_3d``, one bf16-autocast SGD step per :meth:`step`."""

    def __init__(self, device: torch.device, size: int, width: int | None) -> None:
        from trainer.models import CosmoFlow

        torch.manual_seed(0)
        kw = {} if width is None else {"conv_size": width}
        model = CosmoFlow(CHANNELS, OUTPUTS, input_size=size, n_conv=N_CONV, **kw)
        self.width = model.features[0].out_channels
        self.model = model.to(device, memory_format=torch.channels_last_3d)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4, momentum=0.9)
        self.device = device
        if device.type == "cuda":
            torch.backends.cudnn.benchmark = True

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        x = x.contiguous(memory_format=torch.channels_last_3d)
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            out = self.model(x)
        loss = torch.nn.functional.mse_loss(out.float(), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def rate(
        self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]], warmup: int, steps: int
    ) -> float:
        """Samples/s of ``steps`` steps on ``batches``, after ``warmup`` untimed steps."""
        for _ in range(warmup):
            self.step(*next(batches))
        self.sync()
        n, t0 = 0, time.perf_counter()
        for _ in range(steps):
            x, y = next(batches)
            self.step(x, y)
            n += x.shape[0]
        self.sync()
        return n / (time.perf_counter() - t0)


class HostStep(Trainer):
    """A step of ``ms`` milliseconds of Python on the calling thread, the GIL held (switched
    out only as the interpreter forces), in place of the model: the host side of a trainer
    whose GPU work is asynchronous."""

    def __init__(self, device: torch.device, ms: float) -> None:
        self.device, self.seconds, self.width = device, ms / 1e3, None

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        end = time.perf_counter() + self.seconds
        while time.perf_counter() < end:
            pass


# ----------------------------------------------------------------------------- the feeds


def batches_of(
    loader: Iterable[dict[str, torch.Tensor]], device: torch.device, on_device: bool
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(x, y)`` on ``device`` from ``loader``, epoch after epoch. ``on_device``: the loader
    delivers there itself (checked), else each batch is copied there (``non_blocking``)."""
    while True:
        n = 0
        for batch in loader:
            x, y = batch["x"], batch["y"]
            del batch
            if on_device:
                if x.device != device:
                    raise RuntimeError(f"device={device} asked, the loader gave {x.device}")
            else:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            n += 1
            yield x, y
        if not n:
            raise RuntimeError("an epoch without a batch")


@dataclass
class Setup:
    args: argparse.Namespace
    path: str
    device: torch.device
    resident: tuple[torch.Tensor, torch.Tensor]  # (a)'s batch, on the device
    service: Service | None = None


def open_feed(
    case: str, workers: int | None, s: Setup
) -> tuple[Iterator[tuple[torch.Tensor, torch.Tensor]], Callable[[], None]]:
    """The batches of one feed and how to close it."""
    cuda = s.device.type == "cuda"
    if case == "a":
        return itertools.repeat(s.resident), lambda: None
    if case == "e":
        dl = DataLoader(
            H5Samples(s.path), batch_size=s.args.batch, shuffle=True, drop_last=True,
            num_workers=workers, persistent_workers=True, pin_memory=cuda,
        )  # fmt: skip
        return batches_of(dl, s.device, on_device=False), lambda: None
    from datastore import DataStoreLoader, ServiceOptions

    kw: dict[str, Any] = {"batch_size": s.args.batch, "seed": 0, "prefetch": s.args.prefetch}
    if cuda:  # as users would write it (device= pins the staging buffers by itself too)
        kw.update(device=s.device, pin_memory=True)
    if case != "b":
        assert s.service is not None
        if case == "c":
            kw["service"] = ServiceOptions(s.service.socket, transport="shm")
        else:
            kw["service"] = ServiceOptions(s.service.tcp, token=s.service.token, transport="inline")
    loader = DataStoreLoader(s.path, **kw)
    return batches_of(loader, s.device, on_device=cuda), loader.close


@dataclass
class Feed:
    """One feed over the reps: samples/s per rep, or why it could not run."""

    case: str
    workers: int | None = None
    rates: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def key(self) -> str:
        return self.case if self.workers is None else f"{self.case}{self.workers}"

    @property
    def title(self) -> str:
        extra = "" if self.workers is None else f", num_workers={self.workers}"
        return TITLES[self.case] + extra


def run_feeds(s: Setup, trainer: Trainer) -> list[Feed]:
    args = s.args
    feeds = [Feed(c) for c in FEEDS if c in args.cases and c != "e"]
    if "e" in args.cases:
        feeds += [Feed("e", w) for w in args.workers]
    for _ in range(4 * args.warmup):  # one-time costs (autotuning, allocator) before any case
        trainer.step(*s.resident)
    trainer.sync()
    for rep in range(args.reps):
        for feed in feeds if rep % 2 == 0 else feeds[::-1]:
            if feed.error is not None:
                continue
            try:
                batches, close = open_feed(feed.case, feed.workers, s)
                try:
                    feed.rates.append(trainer.rate(batches, args.warmup, args.steps))
                finally:
                    if hasattr(batches, "close"):
                        batches.close()
                    close()
                    del batches, close
                    gc.collect()
            except Exception as exc:  # reported with the others; the run goes on
                traceback.print_exc()
                feed.error = f"{type(exc).__name__}: {exc}"
            got = f"{feed.rates[-1]:.1f} samples/s" if feed.error is None else "FAILED"
            print(f"rep {rep + 1}: {feed.title}: {got}", flush=True)
            if feed.error is not None:
                print(f"  {feed.error}", flush=True)
    return feeds


# ----------------------------------------------------------------------------- limits, gather


def batch_bytes(args: argparse.Namespace) -> int:
    return args.batch * sample_bytes(args.size)


def memcpy_by_threads(args: argparse.Namespace, pinned: bool) -> dict[int, list[float]]:
    return {n: memcpy_gbps(batch_bytes(args), n, args.copies, pinned) for n in args.threads}


def host_to_device(args: argparse.Namespace, device: torch.device) -> dict[str, list[float]]:
    """GB/s of copying one batch's bytes to ``device`` from pinned and from pageable memory."""
    nbytes = batch_bytes(args)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for kind, src in (
        ("pinned", torch.ones(nbytes, dtype=torch.uint8).pin_memory()),
        ("pageable", torch.ones(nbytes, dtype=torch.uint8)),
    ):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        rates = []
        for _ in range(args.copies):
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
            rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
        out[kind] = rates
        del src
    return out


def deliver_epoch(loader: Iterable[dict[str, torch.Tensor]]) -> int:
    """One epoch, each batch consumed trivially (one element of each field read): its bytes."""
    nbytes = 0
    for batch in loader:
        for t in batch.values():
            float(t.reshape(-1)[0])
            nbytes += t.nbytes
    return nbytes


@dataclass
class Gather:
    """The loader's delivery with ``threads`` gather threads vs the memcpy ceiling (GB/s)."""

    threads: int
    memcpy: list[float]
    loader: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ratio(self) -> float:
        return median(self.loader) / median(self.memcpy) if self.loader else float("nan")


def run_gather(
    args: argparse.Namespace, path: str, memcpy: dict[int, list[float]], pinned: bool
) -> list[Gather]:
    from datastore import DataStoreLoader

    out = [Gather(n, memcpy[n]) for n in args.threads]
    for rep in range(args.reps):
        for g in out if rep % 2 == 0 else out[::-1]:
            if g.error is not None:
                continue
            try:
                loader = DataStoreLoader(
                    path, batch_size=args.batch, seed=0, threads=g.threads, pin_memory=pinned,
                    prefetch=args.prefetch,
                )  # fmt: skip
                try:
                    deliver_epoch(loader)  # epoch 1, untimed
                    t0 = time.perf_counter()
                    nbytes = sum(deliver_epoch(loader) for _ in range(args.epochs))
                    g.loader.append(nbytes / (time.perf_counter() - t0) / 1e9)
                finally:
                    loader.close()
            except Exception as exc:
                traceback.print_exc()
                g.error = f"{type(exc).__name__}: {exc}"
            got = f"{g.loader[-1]:.2f} GB/s" if g.error is None else f"FAILED: {g.error}"
            print(
                f"rep {rep + 1}: gather, threads={g.threads}: {got} (memcpy "
                f"{median(g.memcpy):.2f} GB/s)",
                flush=True,
            )
    return out


# ----------------------------------------------------------------------------- the report


def report(
    args: argparse.Namespace,
    device: torch.device | None,
    width: int | None,
    feeds: list[Feed],
    memcpy: dict[int, list[float]],
    h2d: dict[str, list[float]],
    gather: list[Gather],
    pinned: bool,
    notes: list[str],
) -> str:
    sb = sample_bytes(args.size)
    lines: list[str] = []
    ceiling = next((f for f in feeds if f.case == "a" and f.rates), None)
    model = (
        f"{args.host_step:g} ms of Python holding the GIL (--host-step)"
        if args.host_step
        else f"CosmoFlow (conv_size {width}, {N_CONV} blocks)"
    )
    if feeds:
        lines += [
            f"Training steps fed by each pipeline: {model}, batch {args.batch} of "
            f"4x{args.size}^3 float32 ({sb / MIB:.1f} MiB a sample)"
            + ("" if args.host_step else ", bf16 autocast, channels_last_3d")
            + f", on {device_name(device)}",
            "",
            "| case | samples/s | range | input GB/s | ratio to (a) | target | |",
            "|---|---:|---|---:|---:|---|---|",
        ]
        for f in feeds:
            if f.error is not None:
                target = f">= {TARGETS[f.case]}x" if f.case in TARGETS else ""
                lines.append(f"| {f.title} | failed | | | | {target} | |")
                continue
            rate = median(f.rates)
            ratio = rate / median(ceiling.rates) if ceiling else float("nan")
            ok = verdict(ratio >= TARGETS[f.case]) if f.case in TARGETS and ceiling else ""
            target = f">= {TARGETS[f.case]}x" if f.case in TARGETS else ""
            lines.append(
                f"| {f.title} | {rate:.1f} | {spread(f.rates, '{:.1f}')} | {rate * sb / 1e9:.2f} "
                f"| {ratio:.2f}x | {target} | {ok} |"
            )
        best = [f for f in feeds if f.case == "e" and f.rates]
        if best:
            b = max(best, key=lambda f: median(f.rates))
            lines.append(f"\nbest (e): num_workers={b.workers}, {median(b.rates):.1f} samples/s")
        lines += [f"- {f.title}: {f.error}" for f in feeds if f.error is not None]
        lines.append("")
    if memcpy:
        where = "pinned" if pinned else "pageable"
        lines += [
            f"memcpy of one batch ({batch_bytes(args) / MIB:.0f} MiB) into {where} memory by "
            "thread count (GB/s, median [range]):",
            "",
            "| threads | memcpy GB/s | range |",
            "|---:|---:|---|",
            *(f"| {n} | {median(v):.2f} | {spread(v)} |" for n, v in memcpy.items()),
            "",
        ]
    if h2d:
        lines += [
            f"host -> device, one batch: pinned {median(h2d['pinned']):.2f} GB/s "
            f"[{spread(h2d['pinned'])}], pageable {median(h2d['pageable']):.2f} GB/s "
            f"[{spread(h2d['pageable'])}]",
            "",
        ]
    if gather:
        lines += [
            f"gather into the loader's batch buffers ({'pinned' if pinned else 'pageable'}) vs "
            f"the memcpy ceiling at the same thread count, epochs >= 2 ({args.epochs} timed):",
            "",
            "| threads | loader GB/s | range | memcpy GB/s | ratio | target | |",
            "|---:|---:|---|---:|---:|---|---|",
        ]
        for g in gather:
            if g.error is not None:
                lines.append(
                    f"| {g.threads} | failed | | {median(g.memcpy):.2f} | | >= {GATHER_TARGET}x | |"
                )
                continue
            lines.append(
                f"| {g.threads} | {median(g.loader):.2f} | {spread(g.loader)} "
                f"| {median(g.memcpy):.2f} | {g.ratio:.2f}x | >= {GATHER_TARGET}x "
                f"| {verdict(g.ratio >= GATHER_TARGET)} |"
            )
        errors = {g.error for g in gather if g.error is not None}
        lines += [f"- gather: {e}" for e in sorted(errors)]
        lines.append("")
    lines += [
        f"- data: {args.samples} samples x {sb / MIB:.1f} MiB (x float32 (4, {args.size}, "
        f"{args.size}, {args.size}), y float32 (4,)), one HDF5 chunk per sample; batch "
        f"{args.batch}; page cache warm",
        f"- reps {args.reps}, the order reversed every other rep; medians, ranges = min-max "
        f"over the reps; our loaders' prefetch {args.prefetch}"
        + (
            f"; per feed and rep: {args.warmup} untimed steps, then {args.steps} timed (the "
            f"model warmed up with {4 * args.warmup} steps before the first)"
            if feeds
            else ""
        ),
        *notes,
        "- machine: " + machine_info(f"torch {torch.__version__}", f"h5py {h5py.__version__}"),
    ]
    return "\n".join(lines) + "\n"


def device_name(device: torch.device | None) -> str:
    if device is None:
        return "no device"
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} ({device})"
    return f"the CPU ({cores()} cores; a smoke test, not a GPU figure)"


def as_json(
    args: argparse.Namespace,
    device: torch.device | None,
    feeds: list[Feed],
    memcpy: dict[int, list[float]],
    h2d: dict[str, list[float]],
    gather: list[Gather],
    pinned: bool,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The results (every feed's samples/s with its range and ratio to (a), the machine's
    limits, the gather by thread count) and the key ratios: each feed vs (a) (from a GPU run
    only), the gather vs memcpy at the most threads. ``cuda``: whether the feeds ran on a GPU."""
    ceiling = next((median(f.rates) for f in feeds if f.case == "a" and f.rates), None)
    results = {
        "args": {k: v for k, v in vars(args).items() if k != "json"},
        "device": device_name(device),
        "cuda": device is not None and device.type == "cuda",
        "sample_bytes": sample_bytes(args.size),
        "feeds": {
            f.key: {
                "case": f.case,
                "workers": f.workers,
                "title": f.title,
                "samples_per_s": stats(f.rates),
                "ratio_to_ceiling": median(f.rates) / ceiling if f.rates and ceiling else None,
                "target": TARGETS.get(f.case),
                "error": f.error,
            }
            for f in feeds
        },
        "memcpy_gbps": {"pinned": pinned, "by_threads": {n: stats(v) for n, v in memcpy.items()}},
        "host_to_device_gbps": {k: stats(v) for k, v in h2d.items()},
        "gather": {
            g.threads: {
                "loader_gbps": stats(g.loader),
                "memcpy_gbps": stats(g.memcpy),
                "ratio": g.ratio if g.loader else None,
                "target": GATHER_TARGET,
                "error": g.error,
            }
            for g in gather
        },
    }
    ratios = []
    best = max(
        (f for f in feeds if f.case == "e" and f.rates), key=lambda f: median(f.rates), default=None
    )
    for f in feeds if results["cuda"] else ():  # a CPU smoke run's figures mean nothing
        if ceiling and f.rates and f.case != "a" and (f.case != "e" or f is best):
            r = median(f.rates) / ceiling
            target = TARGETS.get(f.case)
            ratios.append(
                key_ratio(
                    f"{f.title} vs (a) on {device_name(device)}",
                    ours=median(f.rates),
                    peer=ceiling,
                    unit="samples/s",
                    ratio=r,
                    of="ours / resident samples/s",
                    target=f">= {target}x" if target else "",
                    ok=r >= target if target else None,
                )
            )
    done = [g for g in gather if g.loader]
    if done:
        g = done[-1]
        ratios.append(
            key_ratio(
                f"gather into the loader's batch buffers vs memcpy, threads={g.threads}",
                ours=median(g.loader),
                peer=median(g.memcpy),
                unit="GB/s",
                ratio=g.ratio,
                of="ours / memcpy GB/s",
                target=f">= {GATHER_TARGET}x",
                ok=g.ratio >= GATHER_TARGET,
            )
        )
    return results, ratios


# ----------------------------------------------------------------------------- main


def pick_device(args: argparse.Namespace) -> tuple[torch.device | None, str | None]:
    """The device the feeds run on, or ``None`` (and why) when they cannot run."""
    if args.device is None:
        if not torch.cuda.is_available():
            return None, (
                "no CUDA here: the GPU cases (a)-(e) and the host -> device copies are skipped "
                "(--device cpu runs (a)-(e) on the CPU as a smoke test); the CPU half follows"
            )
        args.device = "cuda"
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit(f"--device {args.device}: CUDA is not available")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device, None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    device, why = pick_device(args)
    if why:
        print(f"NOTE: {why}", flush=True)
    cuda = device is not None and device.type == "cuda"
    pinned = torch.cuda.is_available()
    want_feeds = [c for c in args.cases if c in FEEDS] if device is not None else []
    work = os.path.abspath(args.dir) if args.dir else tempfile.mkdtemp(prefix="gpu-feed-")
    os.makedirs(work, exist_ok=True)
    service: Service | None = None
    notes: list[str] = []
    try:
        path = ensure_data(work, args.samples, args.size)
        notes.append(f"- page cache warmed by one read of the file ({warm_cache(path):.1f} s)")
        feeds: list[Feed] = []
        width = None
        if want_feeds:
            assert device is not None
            with h5py.File(path, "r") as f:
                x = torch.from_numpy(f["x"][: args.batch]).to(device)
                y = torch.from_numpy(f["y"][: args.batch]).to(device)
            if {"c", "d"} & set(want_feeds):
                service = Service(tcp="d" in want_feeds)
                service.load(path)
            trainer = (
                HostStep(device, args.host_step)
                if args.host_step
                else Trainer(device, args.size, args.width)
            )
            width = trainer.width
            setup = Setup(args, path, device, (x, y), service)
            feeds = run_feeds(setup, trainer)
            del trainer, setup, x, y
            gc.collect()
        memcpy: dict[int, list[float]] = {}
        h2d: dict[str, list[float]] = {}
        if "limits" in args.cases or "gather" in args.cases:
            memcpy = memcpy_by_threads(args, pinned)
            for n, v in memcpy.items():
                print(f"memcpy, threads={n}: {median(v):.2f} GB/s", flush=True)
        if "limits" in args.cases and cuda:
            assert device is not None
            h2d = host_to_device(args, device)
        gather = run_gather(args, path, memcpy, pinned) if "gather" in args.cases else []
    finally:
        if service is not None:
            service.stop()
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    text = report(
        args, device, width, feeds, memcpy if "limits" in args.cases or gather else {}, h2d,
        gather, pinned, notes,
    )  # fmt: skip
    print("\n" + text, end="")
    print(f"(benchmark wall time {time.perf_counter() - t_start:.0f} s)")
    if args.json:
        write_results(
            args.json, "gpu_feed", *as_json(args, device, feeds, memcpy, h2d, gather, pinned),
            f"torch {torch.__version__}", f"h5py {h5py.__version__}",
        )  # fmt: skip
    failed = [f.key for f in feeds if f.error] + [f"gather{g.threads}" for g in gather if g.error]
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
