"""The trainer's process group starts under an MPI that moves messages only inside MPI calls.

Rank 0 picks the rendezvous port and broadcasts it over MPI, then waits in the TCP rendezvous,
outside MPI. The PyPI mpich wheel's OFI netmod without auto progress (what deploy/README.md
tells wheel users to set across nodes; ``MPIR_CVAR_NOLOCAL`` sends every message through the
netmod on one host too) delivered the broadcast only when rank 0 next entered MPI, so rank 1
never joined and the group timed out ("1/2 clients joined"). A barrier after the broadcast
keeps rank 0 in MPI until every rank has the port.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import MPIEXEC

from staging.cluster import LAUNCH_ENV
from staging.launcher import is_open_mpi

ROOT = Path(__file__).resolve().parents[1]
JOB = """
import datetime, torch, torch.distributed as dist
from trainer.grid import init_distributed
rank, world = init_distributed(timeout=datetime.timedelta(seconds=20))
t = torch.ones(1)
dist.all_reduce(t)
print(f"rank {rank} of {world}: {int(t.item())}", flush=True)
dist.destroy_process_group()
"""

pytestmark = pytest.mark.mpi


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")
def test_the_group_starts_when_mpi_progresses_only_inside_calls():
    if is_open_mpi(MPIEXEC):
        pytest.skip("MPICH's netmod variables: the mpich wheel's mpiexec runs this test")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env.update(
        PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
        MPIR_CVAR_CH4_NETMOD="ofi", MPIR_CVAR_NOLOCAL="1",
    )  # fmt: skip
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", "-c", JOB]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the two ranks' lines may interleave in the launcher's output
    assert sorted(re.findall(r"rank (\d) of 2: 2", proc.stdout)) == ["0", "1"], proc.stdout
