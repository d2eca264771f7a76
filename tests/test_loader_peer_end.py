"""A peer that failed or exited mid-epoch is reported as such, with its error, not as a loop
bug (issue 22, 2d); a peer that broke its loop is still told as one (``RankMismatch``); a peer
that cannot read the samples it owns tells the ranks waiting for them at once."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from helpers import MPIEXEC, job_env, mpi_job, rank_rows

from staging.cluster import LAUNCH_ENV

pytestmark = pytest.mark.slow  # jobs of several processes: not in `make test-quick`

JOB = os.path.join(os.path.dirname(__file__), "mpi_jobs", "peer_end_job.py")
OWNER_JOB = os.path.join(os.path.dirname(__file__), "mpi_jobs", "owner_fails_job.py")
N = 32  # 8 steps of 2 samples a rank


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("ends") / "d.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.zeros((N, 2, 4, 4, 4), np.float32)
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(via: str, how: str, data: str, out: str) -> dict:
    """Rank 0's row; the job's exit status is the launcher's business (a rank failed)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    args = [sys.executable, JOB, via, how, data, out]
    if via == "mpi":
        subprocess.run([MPIEXEC, "-n", "2", *args], env=env, capture_output=True, timeout=90)
    else:
        env.update(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        procs = [
            subprocess.Popen(args, env={**env, "RANK": str(r)}, stderr=subprocess.DEVNULL)
            for r in range(2)
        ]
        for p in procs:
            try:
                p.wait(timeout=90)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    with open(f"{out}.0.json") as f:
        return json.load(f)


@pytest.mark.parametrize("via", [pytest.param("mpi", marks=pytest.mark.mpi), "torch"])
def test_a_peer_that_failed_is_named_with_its_error(data, tmp_path, via):
    row = run(via, "fail", data, str(tmp_path / "out"))
    kind, text = row["error"]
    assert kind == "PeerFailed", row
    assert text.startswith("rank 1 failed (ValueError: boom at batch 2) before step "), text
    assert "while this rank went on" in text


@pytest.mark.mpi
def test_a_peer_that_exited_in_its_loop_is_named(data, tmp_path):
    """``sys.exit`` in one rank's loop: a loop that differs, and the peer says it exited."""
    row = run("mpi", "exit", data, str(tmp_path / "out"))
    kind, text = row["error"]
    assert kind == "RankMismatch", row
    assert text.startswith("rank 1 stopped iterating before step "), text
    assert ", and then rank 1 exited: every rank must take the same batches" in text


def test_a_peer_killed_is_gone_not_late(data, tmp_path):
    """SIGKILL leaves no report: gloo's closed connection says the peer is gone (not a
    timeout, not a loop bug)."""
    row = run("torch", "kill", data, str(tmp_path / "out"))
    kind, text = row["error"]
    assert kind == "PeerFailed", row
    assert text.startswith("rank 1 is gone: "), text  # at the step check, or in the exchange
    assert text.endswith("; it exited or failed"), text


def test_a_peer_that_broke_its_loop_is_a_loop_bug(data, tmp_path):
    """(MPI: tests/test_loader_stops_mpi.py, ``stop_idle``.)"""
    row = run("torch", "break", data, str(tmp_path / "out"))
    kind, text = row["error"]
    assert kind == "RankMismatch", row
    assert text.startswith("rank 1 stopped iterating before step "), text
    assert "exited" not in text  # it lives on


@pytest.mark.mpi
def test_a_peer_that_cannot_read_what_it_owns_is_named_with_its_error_at_once(tmp_path):
    """Rank 1 cannot read the samples it owns (their files removed) at step 4, where rank 0
    waits for two of them: rank 0 raises PeerFailed with rank 1's error within seconds (it
    waited out the 30 s timeout, then said only that rank 1 had not sent)."""
    root = tmp_path / "d"
    root.mkdir()
    for k in range(N):
        np.save(root / f"s{k:02d}.npy", np.full((2, 8, 8, 8), k, np.float32))
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    out = str(tmp_path / "out")
    cmd = [MPIEXEC, "-n", "2", sys.executable, OWNER_JOB, str(root), out]
    subprocess.run(cmd, env=env, capture_output=True, timeout=90)
    zero, one = (json.loads(Path(f"{out}.{r}.json").read_text()) for r in (0, 1))
    assert one["batches"] == zero["batches"] == 4  # steps 0-3: samples 0-15, rank 0's
    kind, text = one["error"]
    assert text.startswith(f"{root}/s16.npy: "), one  # the first it sends at step 4
    kind0, text0 = zero["error"]
    assert kind0 == "PeerFailed", zero
    assert text0.startswith(f"rank 1 failed ({kind}: "), text0
    assert "s16.npy" in text0 and "at step 4 of the MPI exchange" in text0, text0
    assert zero["seconds"] < 15, zero


@pytest.mark.mpi
def test_a_peer_whose_preload_fails_is_named_with_its_error_at_once(tmp_path):
    """Rank 1 cannot read sample 2 (a shape that differs, a virtual source gone) when the
    loader is made: it raises its error, rank 0 a PeerFailed with it, both at once (rank 0 went
    on and waited out the timeout for step 0's batch, then ExchangeTimeout)."""
    job = os.path.join(os.path.dirname(__file__), "mpi_jobs", "preload_fails_job.py")
    out = tmp_path / "out"
    cmd = mpi_job(2, Path(job), tmp_path, out, "shape", "vds")
    zero, one = rank_rows(cmd, str(out), 2, job_env())
    why = {
        "shape": ("DatasetError", "dataset <f4 (5,) differs from the first file's <f4 (4,)"),
        "vds": ("SourceMissing", "its virtual source 'src.h5' is in none of the places HDF5"),
    }
    for case, (kind, what) in why.items():
        text = one[case]["error"][1]
        assert one[case]["error"][0] == kind, one
        assert text.startswith(f"{tmp_path}/{case}/q2.h5: field 'x': {what}"), text
        assert zero[case]["error"] == [
            "PeerFailed",
            f"rank 1 failed ({kind}: {text}) while reading its samples (preload), before the "
            "first step",
        ]
        assert zero[case]["seconds"] < 1 and one[case]["seconds"] < 1, (zero, one)
