"""Shared fixtures; the helpers themselves live in ``helpers.py``."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# One OpenMP thread per process, as torchrun sets for its ranks: the suite runs several workers
# and their jobs' ranks on few cores, where every extra thread of each process spins idle in
# OpenMP's barriers (-19% CPU time of test_loader.py on 2 cores). Before anything imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The MPICH wheel's UCX opens every network device when a rank starts, and test_slurm.py's
# namespaced node adds and removes a veth pair meanwhile: a rank died in MPI_Init
# ("uct_iface_open(tcp/dsv14491a) failed: No such device"). The suite's mpiexec jobs run on
# this host: loopback only (the Slurm jobs use MPICH's OFI netmod, which this leaves alone).
os.environ.setdefault("UCX_NET_DEVICES", "lo")
# Tests fork this process (fork Pools, forked gloo ranks); gRPC's fork handlers, with another
# test's gRPC threads still calling into it, killed such children (SIGSEGV, SIGABRT: 70 of 300
# forks here; CI lost a stage run that way). gRPC reads the setting when it is imported: it is
# set for this process's import alone, so the services and jobs the tests start run as shipped.
if "GRPC_ENABLE_FORK_SUPPORT" not in os.environ:
    os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "false"
    import grpc  # noqa: F401

    del os.environ["GRPC_ENABLE_FORK_SUPPORT"]
sys.path.insert(0, str(Path(__file__).parent))

import helpers

# The modules that take longest (`pytest --durations`: 45-350 s each, 2 loaded cores), first:
# `make test` hands whole modules to its pytest-xdist workers in this order, so that none is
# left with a long module at the end while the other has finished.
LONGEST_FIRST = (
    "test_slurm.py", "test_trainer_hybrid.py", "test_service_campaign.py", "test_torch_exchange.py",
    "test_deploy.py", "test_loader_stops_mpi.py", "test_trainer_halo.py", "test_soak.py",
    "test_trainer_preflight.py", "test_loader_traps_mpi.py",
)  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run :data:`LONGEST_FIRST`'s modules first; every module's tests keep their order."""
    rank = {name: k for k, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture
def run_stage():
    """``run_stage(*args, env=None, check=None)``: the real CLI in a subprocess."""
    return helpers.run_stage


@pytest.fixture
def make_tree():
    """``make_tree(root, seed=0)``: build the standard small source tree under ``root``."""
    return helpers.make_tree


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A fresh directory with a short path (``ds-XXXXXXXX`` in the system's temporary directory,
    ``/tmp`` unless ``TMPDIR`` says otherwise), removed afterwards, for what holds Unix sockets
    (at most 105 bytes of path): ``tmp_path`` grows with the user's name and pytest-xdist's
    worker directories."""
    path = Path(tempfile.mkdtemp(prefix="ds-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def mapped_files() -> set[str]:
    """Every file some live process has mapped (``/proc/*/maps``)."""
    mapped: set[str] = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        with contextlib.suppress(OSError), open(maps) as fh:
            mapped.update(line.split(None, 5)[-1].strip() for line in fh if "/dev/shm/" in line)
    return mapped


@pytest.fixture(scope="module", autouse=True)
def no_stale_mpich_shm():
    """Aborted MPICH jobs leave /dev/shm segments for good (2 MiB each); remove the ones a
    module's tests created that no live process still maps (another job running beside the
    tests keeps its own). Every module: any may launch an MPI job."""
    before = set(glob.glob("/dev/shm/mpich*"))
    yield
    new = set(glob.glob("/dev/shm/mpich*")) - before
    for path in new - mapped_files() if new else ():
        with contextlib.suppress(OSError):
            os.unlink(path)
