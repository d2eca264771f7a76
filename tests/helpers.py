"""Shared test helpers: source trees, archives and DEST snapshots for the ``datastore stage``
tests; a ``datastore serve`` for the trainer tests; the environment and launch of test jobs."""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import zstandard

from staging.cluster import LAUNCH_ENV
from staging.launcher import is_open_mpi

META = ".datastore"
ROOT = Path(__file__).parent.parent  # the repository

# DATASTORE_TEST_MPIEXEC (`make test-openmpi`: Open MPI's), else the venv's (pip's mpich), else
# the one on PATH
MPIEXEC = (
    os.environ.get("DATASTORE_TEST_MPIEXEC")
    or shutil.which("mpiexec", path=os.path.dirname(sys.executable))
    or shutil.which("mpiexec")
)
# What Open MPI's mpiexec needs to run the tests' jobs (MPICH's Hydra needs none of it): more
# ranks than cores, ranks that yield the core while they wait (a busy CI machine), as root
# (CI), in containers without ptrace (no CMA single copy), and singletons that start no orted
# (two at once race for the session directory).
OPEN_MPI_ENV = {
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
    "OMPI_MCA_mpi_yield_when_idle": "1",
    "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
    "OMPI_MCA_ess_singleton_isolated": "1",
    "OMPI_ALLOW_RUN_AS_ROOT": "1",  # read only when root
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
}


if MPIEXEC and is_open_mpi(MPIEXEC):  # every test's children inherit it
    for _name, _value in OPEN_MPI_ENV.items():
        os.environ.setdefault(_name, _value)


# (relative path, size in bytes, mode) of the regular files of ``make_tree``.
TREE_FILES = (
    ("empty.txt", 0, 0o644),
    ("one.bin", 1, 0o600),
    ("a/small.txt", 100, 0o640),
    ("a/page.bin", 4096, 0o644),
    ("a/b/odd.bin", 65_537, 0o755),
    ("a/b/c/deep.bin", 300_001, 0o604),
    ("z/last.bin", 12_345, 0o644),
)
TREE_EMPTY_DIRS = ("emptydir", "a/b/hollow")
# A fixed, distinctive mtime so that "preserved" cannot mean "it happens to be now".
BASE_MTIME_NS = 1_600_000_000_123_456_789


def run_stage(
    *args: str | os.PathLike,
    env: dict[str, str] | None = None,
    check: int | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m datastore stage ARGS`` as a single process (no MPI launcher variables).

    ``check``: the exit code the run must have; the assertion shows both output streams.
    """
    full_env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    full_env.pop("DATASTORE_DEBUG", None)
    if env:
        full_env.update(env)
    proc = subprocess.run(
        [sys.executable, "-m", "datastore", "stage", *map(str, args)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
    )
    if check is not None:
        assert proc.returncode == check, (
            f"exit {proc.returncode}, expected {check}\nstdout:\n{proc.stdout}\n"
            f"stderr:\n{proc.stderr}"
        )
    return proc


def slow_file(path: str | os.PathLike, size: int) -> None:
    """Make ``path`` a file of ``size`` zero bytes, quick to make and to read but slow to stage:
    allocated (``posix_fallocate``), so every byte is written (a sparse file's holes are not),
    or sparse where the filesystem cannot allocate ahead."""
    with open(path, "wb") as f:
        try:
            os.posix_fallocate(f.fileno(), 0, size)
        except OSError:
            f.truncate(size)


def random_bytes(n: int, seed: int) -> bytes:
    """``n`` reproducible pseudo-random bytes."""
    import numpy as np

    return np.random.default_rng(seed).bytes(n)


def make_tree(root: Path, seed: int = 0) -> Path:
    """A small source tree: nested directories, an empty file, empty directories, and files of
    several sizes (random bytes) with distinct modes and mtimes. Returns ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    for i, (rel, size, mode) in enumerate(TREE_FILES):
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(random_bytes(size, seed * 1000 + i))
        p.chmod(mode)
        t = BASE_MTIME_NS + i * 1_000_000_007
        os.utime(p, ns=(t, t))
    for rel in TREE_EMPTY_DIRS:
        (root / rel).mkdir(parents=True, exist_ok=True)
    return root


def tree_bytes(root: Path) -> dict[str, bytes]:
    """``{relative path: content}`` of every regular file under ``root``, ignoring the
    ``.datastore`` metadata directory (symlinks are not followed and not listed)."""
    return {rel: v[1] for rel, v in snapshot(root).items() if v[0] == "file"}


def snapshot(root: Path) -> dict[str, tuple]:
    """Everything under ``root`` except ``.datastore``: ``("dir",)``, ``("file", bytes)`` or
    ``("symlink", target)`` by relative path. Symlinks are recorded, never followed."""
    out: dict[str, tuple] = {}
    root = Path(root)
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        if rel_dir == ".":
            dirnames[:] = [d for d in dirnames if d != META]
            filenames = [f for f in filenames if f != META]
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.normpath(os.path.join(rel_dir, name))
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("symlink", os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir",)
            elif stat.S_ISREG(st.st_mode):
                out[rel] = ("file", Path(path).read_bytes())
            else:
                out[rel] = ("other", stat.S_IFMT(st.st_mode))
    return out


def meta_listing(dest: Path) -> set[str]:
    """Names directly inside ``DEST/.datastore``."""
    return set(os.listdir(Path(dest) / META))


def tar_bytes(
    members: list[tuple[tarfile.TarInfo, bytes | None]], fmt: int = tarfile.GNU_FORMAT
) -> bytes:
    """An uncompressed tar of hand-made members (``data`` is the content of regular files)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for info, data in members:
            if data is not None:
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
            else:
                tf.addfile(info)
    return buf.getvalue()


def write_archive(path: Path, raw_tar: bytes) -> Path:
    """Write uncompressed tar bytes to ``path``, compressed as its suffix says."""
    name = path.name
    if name.endswith((".tar.gz", ".tgz")):
        import gzip

        path.write_bytes(gzip.compress(raw_tar, mtime=0))
    elif name.endswith(".tar.zst"):
        path.write_bytes(zstandard.ZstdCompressor(level=3).compress(raw_tar))
    elif name.endswith(".tar"):
        path.write_bytes(raw_tar)
    else:
        raise ValueError(f"not an archive name: {name}")
    return path


def file_info(name: str, mtime: int = 1_600_000_000, mode: int = 0o644) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.REGTYPE
    info.mtime, info.mode = mtime, mode
    return info


def dir_info(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 1_600_000_000
    return info


def link_info(name: str, target: str, hard: bool = False) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.LNKTYPE if hard else tarfile.SYMTYPE
    info.linkname, info.mode, info.mtime = target, 0o777, 1_600_000_000
    return info


def special_info(name: str, kind: bytes) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.mtime = kind, 0o644, 1_600_000_000
    if kind in (tarfile.CHRTYPE, tarfile.BLKTYPE):
        info.devmajor, info.devminor = (1, 3) if kind == tarfile.CHRTYPE else (7, 0)
    return info


def stage_sharded(
    tmp: Path, write: Callable[[Path], object] | None = None
) -> tuple[Path, dict[str, str]]:
    """20 ``.npy`` samples under ``tmp/src`` (sample ``i`` holds ``i`` at ``[0, 0, 0, 0]``), or
    what ``write(src)`` writes there, staged by ``mpiexec -n 2 datastore stage --mode shard``
    into ``tmp/node{node}``: two "nodes" holding different files. Returns ``(src, env)``: env
    for children (no launcher variables, state and runtime under ``tmp``)."""
    import numpy as np

    src = tmp / "src"
    src.mkdir()
    if write is not None:
        write(src)
    for i in range(20 if write is None else 0):
        vol = np.random.default_rng(i).standard_normal((2, 6, 4, 4)).astype(np.float32)
        vol[0, 0, 0, 0] = i
        np.save(src / f"s{i:03d}.npy", vol)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env.update(XDG_STATE_HOME=str(tmp / "state"), XDG_RUNTIME_DIR=str(tmp))
    stage = [MPIEXEC, "-n", "2", sys.executable, "-m", "datastore", "stage", str(src)]
    stage += ["--to", str(tmp / "node{node}"), "--mode", "shard", "--ranks-per-node", "1", "-q"]
    assert subprocess.run(stage, timeout=120, env=env).returncode == 0
    shares = [sorted(os.listdir(tmp / f"node{k}" / "src")) for k in range(2)]
    assert shares[0] and shares[1] and not set(shares[0]) & set(shares[1])
    return src, env


@contextmanager
def serving(tmp: Path, env: dict[str, str], *args: str, log: Path | None = None) -> Iterator[Path]:
    """A fresh ``datastore serve --socket TMP/ds.sock ARGS`` (its state under ``tmp``) for the
    block, its socket path yielded once it is there; terminated after the block. ``log``: the
    file its log (stderr) goes to (default: discarded)."""
    sock = tmp / "ds.sock"
    env = {**env, "XDG_STATE_HOME": str(tmp / "state")}
    cmd = [sys.executable, "-m", "datastore", "serve", "--socket", str(sock), *args]
    with open(log or os.devnull, "w") as err:
        service = subprocess.Popen(cmd, env=env, stderr=err)
    try:
        deadline = time.monotonic() + 30
        while not sock.exists():
            assert service.poll() is None and time.monotonic() < deadline, "serve did not start"
            time.sleep(0.1)
        yield sock
    finally:
        service.terminate()
        service.wait(30)


def wait_ranks(procs: list[subprocess.Popen], timeout: float) -> None:
    """Wait for every rank's process (started with ``stderr=PIPE, text=True``); each must exit
    0, else the end of its stderr is the failure. Whatever still runs afterwards is killed."""
    try:
        for p in procs:
            _, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, err[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def job_env() -> dict[str, str]:
    """This environment for a child job: no MPI launcher variables, the repository first on
    ``PYTHONPATH``, one OpenMP thread."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        OMP_NUM_THREADS="1",
    )
    return env


def mpi_job(n: int, job: Path, *args: str | os.PathLike) -> list[str]:
    """The command running ``python -m mpi4py JOB ARGS`` on ``n`` ``mpiexec`` ranks."""
    return [MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi4py", str(job), *map(str, args)]


def rank_rows(
    cmd: list[str], prefix: str, world: int, env: dict[str, str] | None = None
) -> list[dict]:
    """Run ``cmd``, a launch of ``world`` ranks that each write ``PREFIX.RANK.json``; it must exit
    0 within 120 s (a hang fails here; the assertion shows the end of its stderr). Returns every
    rank's row, in rank order."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(Path(f"{prefix}.{rank}.json").read_text()) for rank in range(world)]


def trainer_refusals(n: int, command: str, cases: list[list[str]], tmp: Path) -> list[list[dict]]:
    """Run ``trainer COMMAND --set k=v ...`` for each list of ``k=v`` settings of ``cases``,
    one after another in the same ``n`` ``mpiexec`` ranks (``tests/trainer_jobs/
    refusals_job.py``). Returns per case, per rank: its exit ``code``, its ``stderr`` and its
    ``seconds``."""
    spec, prefix = tmp / "cases.json", tmp / "refused"
    spec.write_text(json.dumps([[command, *set_args(sets)] for sets in cases]))
    job = ROOT / "tests" / "trainer_jobs" / "refusals_job.py"
    rows = rank_rows(mpi_job(n, job, spec, prefix), str(prefix), n, job_env())
    return [[rows[rank][case] for rank in range(n)] for case in range(len(cases))]


def set_args(sets: list[str]) -> list[str]:
    """``["k=v", ...]`` as the trainer's ``--set k=v ...`` arguments."""
    return [a for s in sets for a in ("--set", s)]


def run_job(cmd: list[str], out: Path, timeout: float = 300) -> dict:
    """Run ``cmd`` in ``job_env()``; it must exit 0 (the assertion shows its output). Returns
    the JSON it wrote to ``out``."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=job_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(Path(out).read_text())


def ctrl_c_heard(cmd: list) -> list:
    """``cmd`` run so that it hears SIGINT as from a terminal: a run started in the background
    (``cmd &`` without job control, as a CI job may run the tests) inherits it ignored, and
    Python then ignores it too. coreutils' ``env --default-signal`` resets it before the exec;
    a ``preexec_fn`` cannot: it makes Popen fork (not vfork) the test process, and gRPC's fork
    handlers in a process with gRPC threads killed the child (SIGABRT, SIGSEGV) before its exec."""
    return ["env", "--default-signal=INT", *cmd]
