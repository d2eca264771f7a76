"""The launcher's world and MPI's must agree: a job of N ranks, not N jobs of one.

An ``mpiexec`` of one MPI starting processes whose mpi4py loads another MPI (the PyPI ``mpich``
wheel's ``mpiexec`` first on ``PATH`` before the site's, or ``srun --mpi=`` a PMI the library
does not speak) gives every process an ``MPI.COMM_WORLD`` of size 1: N independent jobs that
each believe they are alone, and race. :func:`comm_world` is how every entry point (``datastore
stage``, ``datastore serve``, ``DataStoreLoader``, the trainer) gets ``COMM_WORLD``: it compares
the size with the number of ranks the launcher says it started and raises
:class:`LaunchMismatch`, naming both and the fix, when they disagree.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

__all__ = [
    "SIZE_VARS", "LaunchMismatch", "comm_world", "finalize_mpi", "is_open_mpi", "launcher_size",
    "mismatch", "mpiexec_command",
]  # fmt: skip

# variables launchers set to the number of ranks they started, MPI launchers' first: PMI (MPICH's
# Hydra, srun --mpi=pmi2, Intel MPI), PMIx, Open MPI's mpirun, Slurm's step, Flux
SIZE_VARS = (
    "PMI_SIZE", "PMIX_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS", "FLUX_JOB_SIZE",
)  # fmt: skip


class LaunchMismatch(RuntimeError):
    """The launcher started several ranks, but MPI gives this process a world of its own."""


def _size_var(env: Mapping[str, str]) -> tuple[str, int] | None:
    """``(variable, ranks)`` of the first of :data:`SIZE_VARS` that holds a number."""
    for name in SIZE_VARS:
        value = env.get(name, "")
        if value.isascii() and value.isdigit():  # not "²", a digit to isdigit() but not to int()
            return name, int(value)
    return None


def launcher_size(env: Mapping[str, str] | None = None) -> int | None:
    """The number of ranks a launcher says it started, or ``None`` when none says."""
    found = _size_var(os.environ if env is None else env)
    return None if found is None else found[1]


def mismatch(world_size: int, library: str, env: Mapping[str, str]) -> str | None:
    """Why a world of ``world_size`` cannot be the launcher's job, or ``None`` when it can.

    Args:
        world_size: ``MPI.COMM_WORLD``'s size in this process.
        library: ``MPI.Get_library_version()``.
        env: the process environment.
    """
    found = _size_var(env)
    if found is None or found[1] <= 1 or world_size != 1:
        return None
    name, ranks = found
    first = library.strip().split("\n")[0].split(",")[0]
    library = " ".join(first.split()) or "an MPI"  # "Open MPI v4.1.4", "MPICH Version: 4.2.0"
    mpiexec = shutil.which("mpiexec", path=env.get("PATH")) or "none on PATH"
    why = (
        f"the launcher started {ranks} ranks ({name}={ranks}) but MPI gives this process a "
        f"world of 1: each rank would run alone. mpi4py loaded {library}, "
        "which does not speak this launcher's PMI. Start the job with that MPI's own launcher "
        f"(`mpiexec --version` names its MPI; the first mpiexec on PATH is {mpiexec}) or with "
        "`srun --mpi=$(python deploy/check_mpi.py --srun-mpi)`; deploy/README.md, 'MPI on a "
        "cluster', says how to build mpi4py against the site's MPI"
    )
    wheel = _wheel_libmpi(mpiexec)
    if wheel is not None and "MPICH" not in library:
        why += (
            f". That mpiexec is the mpich wheel's: to run under it, point mpi4py at the wheel's "
            f"library with MPI4PY_LIBMPI={wheel} (mpi4py's binary wheel loaded the first libmpi "
            "it found, here another MPI's)"
        )
    return why


def _wheel_libmpi(mpiexec: str) -> str | None:
    """The PyPI ``mpich`` wheel's ``libmpi.so.12`` beside ``mpiexec`` (``<prefix>/bin`` and
    ``<prefix>/lib``), or ``None`` when ``mpiexec`` is not the wheel's."""
    lib = os.path.join(os.path.dirname(os.path.dirname(mpiexec)), "lib", "libmpi.so.12")
    return lib if os.path.isabs(mpiexec) and os.path.exists(lib) else None


def comm_world(env: Mapping[str, str] | None = None) -> Any:
    """``MPI.COMM_WORLD``, once it is known to be the launcher's whole job.

    Raises:
        LaunchMismatch: the launcher started several ranks and this process sees a world of 1.
    """
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    why = mismatch(comm.Get_size(), MPI.Get_library_version(), os.environ if env is None else env)
    if why is not None:
        raise LaunchMismatch(why)
    return comm


def finalize_mpi() -> None:
    """End MPI with ``MPI_Finalize`` now, where it was started, for a process about to exit
    with a code every rank agreed on (``staging.exitcodes.Agreed``; a rank that fails alone
    must abort instead: the others would wait for it)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()


def is_open_mpi(mpiexec: str) -> bool:
    """Whether ``mpiexec`` is Open MPI's (its ``--version`` names Open MPI or OpenRTE)."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "Open MPI" in out.stdout or "OpenRTE" in out.stdout


def mpiexec_command(mpiexec: str) -> list[str]:
    """``[mpiexec]``, with what Open MPI's needs to start a small job on any machine: more
    ranks than cores (``--oversubscribe``; it refuses with "not enough slots", MPICH's Hydra
    does not), and as root (``--allow-run-as-root``, containers)."""
    if not is_open_mpi(mpiexec):
        return [mpiexec]
    return [mpiexec, "--oversubscribe", *(["--allow-run-as-root"] if os.geteuid() == 0 else [])]
