"""``trainer.comm`` at world 1 in one process (tests/trainer_jobs/comm_job.py): on a GPU the
NCCL branch of ``start_exchange`` (each message sent to the rank itself), the collectives on
NCCL and staged over gloo, and ``comm_clock``'s device timing; on the CPU what the clock counts.
The CUDA tests skip without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from staging.cluster import LAUNCH_ENV

JOB = Path(__file__).parent / "trainer_jobs" / "comm_job.py"
ROOT = Path(__file__).parent.parent
ENV = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
ENV.update(
    PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    OMP_NUM_THREADS="1",
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def run_job(tmp: Path, backend: str) -> dict:
    out = tmp / f"{backend}.json"
    proc = subprocess.run(
        [sys.executable, str(JOB), str(out), backend],
        capture_output=True, text=True, timeout=120, env=ENV,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def nccl(tmp_path_factory) -> dict:
    return run_job(tmp_path_factory.mktemp("nccl"), "nccl")


def test_comm_clock_counts_the_waits_of_each_kind_on_the_cpu(tmp_path):
    got = run_job(tmp_path, "gloo")
    assert (got["all_reduce"], got["all_gather"], got["broadcast"]) == (True, True, True)
    clock = got["clock"]
    assert sorted(clock) == ["all_gather", "all_reduce", "broadcast"]
    for kind, t in clock.items():
        assert t["waits"] == 1, (kind, t)
        assert t["host_wait_s"] >= 0, (kind, t)
        device = ("stall_s", "nccl_s", "nccl_timed", "to_host_s", "to_device_s", "host_copy_s")
        assert [t[k] for k in device] == [0] * 6, (kind, t)  # CPU tensors: no device time
    assert got["clock_after_stop"] == clock  # stopped: the all-reduce after it is not counted
    assert got["clock_after_start"] == {}


@pytest.mark.cuda
@needs_cuda
def test_nccl_start_exchange_at_world_1_delivers_exactly_cuda(nccl):
    assert nccl["backend"] == "nccl"
    ex = nccl["exchange"]
    assert ex["pending_nccl"] is True, ex
    assert ex["exchange"], f"messages to itself over NCCL arrived wrong or out of order: {ex}"
    assert ex["sends_untouched"], ex
    t = ex["clock"]["exchange"]
    assert t["waits"] == 1 and t["host_wait_s"] == 0 and t["stall_s"] >= 0, t
    assert t["to_host_s"] == 0 and t["to_device_s"] == 0, t  # direct: nothing staged


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("path", ["nccl_collectives", "staged_collectives"])
def test_collectives_at_world_1_return_the_input_cuda(nccl, path):
    got = nccl[path]
    assert got["staged"] is (path == "staged_collectives"), got
    checks = ("all_reduce", "all_reduce_max", "all_gather", "broadcast")
    assert [got[k] for k in checks] == [True] * 4, got
    clock = got["clock"]
    assert clock["all_reduce"]["waits"] == 2 and clock["all_gather"]["waits"] == 1, clock
    if path == "staged_collectives":  # 16 MiB each way through pinned memory
        for kind, t in clock.items():
            assert t["to_host_s"] > 0 and t["to_device_s"] > 0 and t["host_copy_s"] > 0, (kind, t)
            assert t["stall_s"] == 0, (kind, t)
    else:
        for kind, t in clock.items():
            assert t["to_host_s"] == t["to_device_s"] == t["host_wait_s"] == 0, (kind, t)


@pytest.mark.cuda
@needs_cuda
def test_comm_clock_sees_the_stream_stall_in_an_nccl_wait_cuda(nccl):
    """A transfer held up behind a side stream's sleep stalls the waiting stream for about the
    sleep; one that ran while the stream computed stalls it for about nothing."""
    sleep, held, hidden = nccl["sleep_s"], nccl["stall_held_up_s"], nccl["stall_hidden_s"]
    ms = sleep * 1e3, held * 1e3, hidden * 1e3
    msg = "sleep {:.2f} ms; stall held up {:.3f} ms, hidden {:.3f} ms".format(*ms)
    assert sleep > 0, msg
    assert held > 0.5 * sleep, msg
    assert hidden < 0.5 * sleep, msg
