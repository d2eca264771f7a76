"""``benchmarks/peers.py``'s link check, end to end: after its MPI store's jobs, two fresh ranks
build what ``datastore serve`` builds on an MPI node and replay the jobs' fetches three ways
(bare mpi4py, bare mpi4py typed into the batch slots, the services' link). The typed replay
and the link fill the slots through independent code (MPI subarray datatypes against
``Resident.start_fetch``, ``MpiPeers`` and the asker's copies); the check fails the run where
their bytes differ, and where the link's fetches do not come in the messages the services
sent (a real ``mpiexec``, a real staged shard). After its gRPC store's jobs, two fresh
processes build what ``datastore serve --peers`` builds (its TCP server, data listener and
gRPC link) and replay the fetches over bare TCP sockets and through the link."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from staging.cluster import LAUNCH_ENV

ROOT = Path(__file__).parent.parent
LINK_REPS = 3  # benchmarks/peers.py's replays of each kind after each job


def _peers(tmp_path: Path, kind: str) -> tuple[str, dict[str, dict]]:
    """``benchmarks/peers.py --quick`` on store ``kind``: its report and its jobs by layout."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env["PYTHONPATH"] = str(ROOT)
    out = tmp_path / "peers.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "peers.py"), "--quick", "--kinds", kind,
           "--epochs", "2", "--dir", str(tmp_path / "data"), "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    jobs = {j["layout"]: j for j in json.loads(out.read_text())["results"]["jobs"]}
    assert sorted(jobs) == ["blocks", "whole"]
    return proc.stdout, jobs


@pytest.mark.mpi
@pytest.mark.slow
def test_the_link_fills_the_slots_as_typed_mpi4py_does_and_both_are_timed(tmp_path):
    report, jobs = _peers(tmp_path, "mpi")
    for job in jobs.values():
        assert job["bare"] == "bare mpi4py"
        for kind in ("bare", "typed", "link"):
            reps = job[f"{kind}_gb_per_s_reps"]
            assert len(reps) == LINK_REPS and min(reps) > 0, (kind, reps)
    typed = "| mpi link / bare mpi4py typed into the slots, same processes and fetches >= 0.8x"
    assert f"{typed} | blocks |" in report and f"{typed} | whole |" not in report


@pytest.mark.slow
def test_the_grpc_link_is_timed_beside_bare_tcp_sockets_on_the_same_fetches(tmp_path):
    report, jobs = _peers(tmp_path, "grpc")
    for layout, job in jobs.items():
        assert job["bare"] == "bare TCP sockets"
        kinds = ("bare", "link", "typed") if layout == "blocks" else ("bare", "link")
        for kind in kinds:
            reps = job[f"{kind}_gb_per_s_reps"]
            assert len(reps) == LINK_REPS and min(reps) > 0, (kind, reps)
        if layout == "whole":  # whole samples land in place: nothing to copy into the slots
            assert job["typed_gb_per_s_reps"] == []
    bare = "| grpc link / bare TCP sockets, same processes and fetches >= 0.8x"
    into = "| grpc link / bare TCP sockets copied into the slots, same processes and fetches"
    assert f"{bare} | whole |" in report and f"{bare} | blocks |" in report
    assert f"{into} >= 0.8x | blocks |" in report
    assert f"{into} >= 0.8x | whole |" not in report
