"""One process (world 1) running ``trainer.comm`` for tests/test_trainer_comm_cuda.py.

Usage: ``comm_job.py OUT BACKEND`` writes ``{check: value}`` JSON to OUT.

``gloo``: CPU tensors; the collectives and what :data:`trainer.comm.comm_clock` counts.
``nccl`` (a CUDA GPU): the NCCL branch of ``start_exchange``, each message sent by the rank to
itself (NCCL matches a pair's messages in posting order, tags ignored) with a kernel running
between start and wait; the collectives on NCCL; the clock's stall (a transfer held up behind a
side stream's sleep stalls the waiting stream by about that sleep; one that ran during the
compute does not); and the staged path (CUDA tensors over a gloo group). gloo cannot send to
its own rank, so the staged ``start_exchange`` needs two ranks (the multi-rank CUDA tests).
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

from trainer.comm import (
    all_gather,
    all_reduce_sum,
    broadcast,
    comm_clock,
    is_staged,
    start_all_reduce,
    start_exchange,
)
from trainer.grid import init_distributed

TIMEOUT = datetime.timedelta(seconds=60)
SLEEP_CYCLES = 50_000_000  # tens of ms of GPU clock


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)


def clock_counts(kinds: dict) -> dict:
    return {k: vars(v) for k, v in kinds.items()}


def cpu_checks() -> dict:
    out: dict = {}
    x = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    comm_clock.start()
    out["all_reduce"] = same(all_reduce_sum(x.clone(), None, TIMEOUT), x)
    out["all_gather"] = [same(g, x) for g in all_gather(x, None, TIMEOUT)] == [True]
    b = x.clone()
    broadcast(b, 0, None, TIMEOUT)
    out["broadcast"] = same(b, x)
    out["clock"] = clock_counts(comm_clock.read())
    comm_clock.stop()
    all_reduce_sum(x.clone(), None, TIMEOUT)
    out["clock_after_stop"] = clock_counts(comm_clock.read())
    comm_clock.start()
    out["clock_after_start"] = clock_counts(comm_clock.read())
    comm_clock.stop()
    return out


def exchange_checks(dev: torch.device) -> dict:
    """Two messages to itself of each shape, posted in one order; a kernel between start and
    wait writes other memory."""
    a = torch.arange(4 * 5 * 6, dtype=torch.float32, device=dev).reshape(4, 5, 6)
    b = -a - 1
    c = torch.arange(7 * 3, dtype=torch.bfloat16, device=dev).reshape(7, 3)
    d = c * 2
    got = [torch.full_like(t, 99) for t in (a, b, c, d)]
    sends = [(0, t, tag) for tag, t in enumerate((a, b, c, d))]
    recvs = [(0, t, tag) for tag, t in enumerate(got)]
    sent = [t.clone() for t in (a, b, c, d)]
    m = torch.randn(512, 512, device=dev)
    comm_clock.start()
    pending = start_exchange(sends, recvs, None, TIMEOUT)
    m = m @ m  # compute while the messages travel
    pending.wait()
    pending.wait()  # idempotent
    times = comm_clock.read()
    comm_clock.stop()
    return {
        "exchange": all(same(g, s) for g, s in zip(got, sent, strict=True)),
        "sends_untouched": all(same(t, s) for t, s in zip((a, b, c, d), sent, strict=True)),
        "pending_nccl": pending.nccl,
        "clock": clock_counts(times),
    }


def collective_checks(dev: torch.device, group) -> dict:
    x = torch.arange(1 << 22, dtype=torch.float32, device=dev)  # 16 MiB: measurable copies
    comm_clock.start()
    out = {
        "staged": is_staged(x, group),
        "all_reduce": same(all_reduce_sum(x.clone(), group, TIMEOUT), x),
        "all_gather": [same(g, x) for g in all_gather(x, group, TIMEOUT)] == [True],
    }
    m = x.clone()
    start_all_reduce(m, group, TIMEOUT, op=dist.ReduceOp.MAX).wait()
    out["all_reduce_max"] = same(m, x)
    b = x.clone()
    broadcast(b, 0, group, TIMEOUT)
    out["broadcast"] = same(b, x)
    out["clock"] = clock_counts(comm_clock.read())
    comm_clock.stop()
    return out


def sleep_s(dev: torch.device) -> float:
    """Device seconds of one ``torch.cuda._sleep(SLEEP_CYCLES)``."""
    before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    before.record()
    torch.cuda._sleep(SLEEP_CYCLES)
    after.record()
    after.synchronize()
    return before.elapsed_time(after) / 1e3


def stall_s(dev: torch.device, late_on_side_stream: bool) -> float:
    """The clock's stall of the current stream in one NCCL all-reduce's wait: the transfer
    queued behind a sleep on a side stream (held up: the stall is about the sleep), or started
    before a sleep on the current stream (hidden behind it: about nothing)."""
    t = torch.ones(1024, device=dev)
    side = torch.cuda.Stream(dev)
    torch.cuda.synchronize(dev)
    comm_clock.start()
    if late_on_side_stream:
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)
            pending = start_all_reduce(t, None, TIMEOUT)  # NCCL waits for the side stream
    else:
        pending = start_all_reduce(t, None, TIMEOUT)
        torch.cuda._sleep(SLEEP_CYCLES)  # compute while the all-reduce runs
    pending.wait()
    stall = comm_clock.read()["all_reduce"].stall_s
    comm_clock.stop()
    if not same(t, torch.ones(1024, device=dev)):
        raise AssertionError("all-reduce of ones at world 1 changed the tensor")
    return stall


def nccl_checks() -> dict:
    dev = torch.device("cuda", 0)
    os.environ["TORCH_NCCL_ENABLE_TIMING"] = "1"  # NCCL's own events, for CommTimes.nccl_s
    init_distributed("nccl", device=dev)
    all_reduce_sum(torch.zeros(1, device=dev), None, TIMEOUT)  # the communicator is up
    out = {"backend": str(dist.get_backend()), "exchange": exchange_checks(dev)}
    out["nccl_collectives"] = collective_checks(dev, None)
    out["staged_collectives"] = collective_checks(dev, dist.new_group([0], backend="gloo"))
    out["sleep_s"] = sleep_s(dev)
    out["stall_held_up_s"] = stall_s(dev, late_on_side_stream=True)
    out["stall_hidden_s"] = stall_s(dev, late_on_side_stream=False)
    return out


def main() -> None:
    path, backend = sys.argv[1], sys.argv[2]
    if backend == "nccl":
        out = nccl_checks()
    else:
        init_distributed("gloo")
        out = cpu_checks()
    with open(path, "w") as fh:
        json.dump(out, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
