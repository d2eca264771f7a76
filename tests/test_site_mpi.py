"""A launcher of one MPI starting processes whose mpi4py loads another (issue 21, 3b): every
entry point refuses, naming the fix, rather than run N jobs of one rank that race.

The real case: MPICH's Hydra ``mpiexec`` (the PyPI ``mpich`` wheel's, left first on ``PATH``)
starting processes whose mpi4py was built against Open MPI: each sees a world of 1. It runs
where mpi4py loads Open MPI (``make test-openmpi``) and Hydra is at hand; the other way round,
the ``mpich`` wheel under Open MPI's ``mpirun``, MPICH itself aborts in ``MPI_Init`` ("unsupported
PMI version PMIx"), before any of our code."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import MPIEXEC

from staging.cluster import LAUNCH_ENV
from staging.launcher import is_open_mpi, launcher_size, mismatch, mpiexec_command

OPEN_MPI = "Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4, repo rev: v4.1.4\n"


@pytest.mark.parametrize(
    ("env", "size", "named"),
    [
        ({"PMI_SIZE": "2"}, 2, "PMI_SIZE=2"),
        ({"OMPI_COMM_WORLD_SIZE": "4", "PMIX_RANK": "0"}, 4, "OMPI_COMM_WORLD_SIZE=4"),
        ({"SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "3"}, 8, "SLURM_STEP_NUM_TASKS=8"),
        ({"PMI_SIZE": "3", "SLURM_STEP_NUM_TASKS": "1"}, 3, "PMI_SIZE=3"),  # mpiexec in a step
    ],
)
def test_a_world_of_one_under_a_launcher_of_several_is_refused_naming_both(env, size, named):
    assert launcher_size(env) == size
    why = mismatch(1, OPEN_MPI, {**env, "PATH": ""})
    assert why.startswith(f"the launcher started {size} ranks ({named}) but MPI gives this ")
    assert "mpi4py loaded Open MPI v4.1.4, which does not speak this launcher's PMI" in why
    assert "the first mpiexec on PATH is none on PATH" in why
    assert "`srun --mpi=$(python deploy/check_mpi.py --srun-mpi)`" in why


def test_under_the_mpich_wheels_mpiexec_the_refusal_names_the_wheels_library(tmp_path):
    """The GPU machine's case: the mpich wheel installed with ``pip --target`` (its mpiexec in
    ``<target>/bin``), mpi4py's binary wheel loading the system's Open MPI instead."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "lib").mkdir()
    (tmp_path / "bin" / "mpiexec").write_text("#!/bin/sh\n")
    (tmp_path / "bin" / "mpiexec").chmod(0o755)
    (tmp_path / "lib" / "libmpi.so.12").write_bytes(b"")
    why = mismatch(1, OPEN_MPI, {"PMI_SIZE": "4", "PATH": str(tmp_path / "bin")})
    assert why.endswith(
        f"MPI4PY_LIBMPI={tmp_path}/lib/libmpi.so.12 (mpi4py's binary wheel loaded the first "
        "libmpi it found, here another MPI's)"
    )
    mpich = "MPICH Version:      4.2.0\n"  # the wheel's own library loaded: no such hint
    assert "MPI4PY_LIBMPI" not in mismatch(
        1, mpich, {"PMI_SIZE": "4", "PATH": str(tmp_path / "bin")}
    )


@pytest.mark.parametrize(
    ("world", "env"),
    [
        (2, {"PMI_SIZE": "2"}),  # the launcher's whole job
        (1, {"PMI_SIZE": "1"}),  # a job of one
        (1, {}),  # no launcher says
        (1, {"PMI_SIZE": "\u00b2"}),  # a digit to isdigit(), not to int()
    ],
)
def test_a_world_the_launcher_agrees_with_passes(world, env):
    assert mismatch(world, OPEN_MPI, env) is None


# -- real launchers ---------------------------------------------------------------------------
def _library() -> str:
    """``MPI_Get_library_version`` of this interpreter's mpi4py (in a child: not initialized)."""
    code = "import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; "
    r = subprocess.run(
        [sys.executable, "-c", code + "print(MPI.Get_library_version())"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    return r.stdout


def _hydra() -> str | None:
    """The ``mpich`` wheel's ``mpiexec`` (MPICH's Hydra), or ``None``."""
    try:
        files = importlib.metadata.distribution("mpich").files or ()
    except importlib.metadata.PackageNotFoundError:
        return None
    found = [f.locate() for f in files if f.parts[-2:] == ("bin", "mpiexec")]
    return str(found[0]) if found and not is_open_mpi(str(found[0])) else None


@pytest.fixture(scope="module")
def foreign(tmp_path_factory) -> tuple[list[str], dict[str, str], Path]:
    """``(Hydra mpiexec -n 2, env, tmp)`` where mpi4py loads Open MPI; skips elsewhere. Each
    rank's stdout and stderr go to its own files (:func:`_said`): Hydra forwarding both ranks'
    to one pipe can split a line of one with the other's (as CI saw once)."""
    if "Open MPI" not in _library():
        pytest.skip("needs mpi4py built against Open MPI (make test-openmpi)")
    hydra = _hydra()
    if hydra is None:
        pytest.skip("needs the mpich wheel's mpiexec (pip install mpich)")
    tmp = tmp_path_factory.mktemp("foreign")
    (tmp / "src").mkdir()
    (tmp / "src" / "a.bin").write_bytes(b"x" * 1000)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env.update(XDG_STATE_HOME=str(tmp / "state"), XDG_RUNTIME_DIR=str(tmp), PYTHONWARNINGS="ignore")
    files = ["-outfile-pattern", str(tmp / "out.%r"), "-errfile-pattern", str(tmp / "err.%r")]
    return [hydra, "-n", "2", *files, sys.executable], env, tmp


def _said(tmp: Path, stream: str) -> list[str]:
    """What each rank of the last launch wrote to ``stream`` (``out`` or ``err``)."""
    return [(tmp / f"{stream}.{rank}").read_text() for rank in (0, 1)]


def _refused_by_both(r: subprocess.CompletedProcess, code: int, tmp: Path) -> list[str]:
    """Each rank's stderr, once checked that both refused the launch and exited ``code``."""
    errs = _said(tmp, "err")
    assert r.returncode == code, errs
    for err in errs:
        assert err.count("the launcher started 2 ranks (PMI_SIZE=2)") == 1, err[-3000:]
        assert err.count("mpi4py loaded Open MPI v") == 1, err[-3000:]
    return errs


@pytest.mark.mpi
def test_stage_under_another_mpis_launcher_exits_2_on_every_rank_and_writes_nothing(foreign):
    launch, env, tmp = foreign
    r = subprocess.run(
        [*launch, "-m", "datastore", "stage", str(tmp / "src"), "--to", str(tmp / "dest")],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    for err in _refused_by_both(r, 2, tmp):
        assert err.count("datastore stage: error: the launcher started 2 ranks") == 1
    assert not (tmp / "dest").exists()


@pytest.mark.mpi
def test_serve_under_another_mpis_launcher_exits_2_logging_why(foreign):
    launch, env, tmp = foreign
    sock = tmp / "run" / "ds{rank}.sock"
    (tmp / "run").mkdir(exist_ok=True)
    r = subprocess.run(
        [*launch, "-m", "datastore", "serve", "--socket", str(sock)],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    for err in _refused_by_both(r, 2, tmp):
        events = [json.loads(ln) for ln in err.splitlines() if ln.startswith("{")]
        assert [e["event"] for e in events if e.get("level") == "error"] == ["launch_mismatch"]
    assert not list((tmp / "run").iterdir())  # no socket


@pytest.mark.mpi
def test_the_loader_under_another_mpis_launcher_raises_launch_mismatch(foreign):
    launch, env, tmp = foreign
    code = (
        "from datastore import DataStoreLoader\n"
        "from staging.launcher import LaunchMismatch\n"
        "try:\n"
        f"    DataStoreLoader({str(tmp / 'src')!r})\n"
        "except LaunchMismatch as exc:\n"
        "    print('LaunchMismatch:', exc, flush=True)\n"
    )
    r = subprocess.run([*launch, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, _said(tmp, "err")
    for out in _said(tmp, "out"):
        assert out.startswith("LaunchMismatch: the launcher started 2 ranks (PMI_SIZE=2)"), out


@pytest.mark.mpi
def test_the_trainer_under_another_mpis_launcher_exits_2(foreign):
    from trainer.cosmology import write_split

    launch, env, tmp = foreign
    write_split(tmp / "cosmo", 8, 4, 8, 0)
    r = subprocess.run(
        [*launch, "-m", "mpi4py", "-m", "trainer", "train", "--set", f"data={tmp / 'cosmo'}"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    for err in _refused_by_both(r, 2, tmp):
        assert err.count("trainer: the launcher started 2 ranks") == 1


@pytest.mark.mpi
def test_the_right_launcher_gives_every_rank_the_whole_world():
    """The converse: this interpreter's MPI under its own launcher (``MPIEXEC``)."""
    assert MPIEXEC, "no mpiexec"
    code = "from staging.launcher import comm_world; c = comm_world(); "
    code += "got = c.gather((c.Get_rank(), c.Get_size())); c.Get_rank() or print(got)"
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    r = subprocess.run(
        [MPIEXEC, "-n", "2", sys.executable, "-c", code],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout == "[(0, 2), (1, 2)]\n"  # rank 0 alone prints


def _open_mpi() -> str | None:
    """Open MPI's ``mpiexec``: ``MPIEXEC``, else the first on PATH that is Open MPI's (the
    ``mpich`` wheel's, ``.venv/bin``, may come first)."""
    dirs = os.environ.get("PATH", "").split(os.pathsep)
    found = [shutil.which("mpiexec", path=d) for d in dirs]
    for candidate in (MPIEXEC, *found):
        if candidate and is_open_mpi(candidate):
            return candidate
    return None


@pytest.mark.mpi
def test_our_mpiexec_command_starts_more_ranks_than_cores_under_open_mpi():
    openmpi = _open_mpi()
    if openmpi is None:
        pytest.skip("needs Open MPI's mpiexec (Debian: openmpi-bin)")
    n = str((os.cpu_count() or 1) + 1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMPI_")}
    bare = subprocess.run(
        [openmpi, "-n", n, "true"], capture_output=True, text=True, timeout=60,
        env={**env, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"},
    )  # fmt: skip
    assert bare.returncode != 0 and "not enough slots" in bare.stdout + bare.stderr
    ours = subprocess.run(
        [*mpiexec_command(openmpi), "-n", n, "true"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert ours.returncode == 0, ours.stderr
    hydra = _hydra()
    if hydra is not None:  # MPICH's needs nothing
        assert mpiexec_command(hydra) == [hydra]
