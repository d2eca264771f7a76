"""The ``datastore`` command: one entry point, a subcommand per job."""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys
import traceback
from collections.abc import Callable
from typing import Any

from datastore._version import __version__
from datastore.plan import plan_cmd
from datastore.readers import inspect_cmd
from datastore.service import cli as service_cli
from staging import cli as stage_cli
from staging.console import Parser, grpc_errors_only, reader_gone, whole_lines
from staging.exitcodes import Agreed, Exit
from staging.launcher import finalize_mpi

__all__ = ["main", "negatives_joined"]

_NEGATIVE = re.compile(r"-(\d|\.\d|inf|nan)", re.IGNORECASE)  # -5G, -.5G, -1e3, -inf

# the commands of the datastore core: (module, name, summary, about); each module gives the
# arguments (add_arguments), what the command does (run) and the end of its help (EPILOG)
COMMANDS = (
    (
        inspect_cmd,
        "inspect",
        "describe a dataset: format, samples, fields (dtype, shape, spatial axes), bytes",
        "Detect the format of a dataset (HDF5, one HDF5 file per sample, zarr, LMDB, .npy/.npz "
        "files, WebDataset-style tar shards) or read a spec file (.json/.toml), and print its "
        "sample count, fields and size. Every file of a set of files is looked into; the first "
        "that does not match the others is named.",
    ),
    (
        plan_cmd,
        "plan",
        "predict staging time, memory and exchange of each layout on a machine, and recommend one",
        "Predict, for a dataset on a machine: the staging time (replicate vs shard), the bytes "
        "each node holds in memory and on NVMe, the exchange each shuffle costs per step, the "
        "memory per rank of each spatial split; and recommend a layout.",
    ),
)


def parser() -> Parser:
    p = Parser(
        prog="datastore",
        description="Stage datasets to node-local storage and feed them to distributed trainers.",
    )
    p.add_argument("--version", action="version", version=f"datastore {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    stage_cli.add_parser(sub)
    sub.choices["stage"].set_defaults(func=_stage)
    command = functools.partial(_command, sub)
    for module, name, summary, about in COMMANDS:
        module.add_arguments(command(name, module.run, summary, about, module.EPILOG))
    service_cli.add_parser(command)
    return p


def _command(
    sub: Any,
    name: str,
    run: Callable[[argparse.Namespace], int],
    summary: str,
    about: str,
    epilog: str,
) -> argparse.ArgumentParser:
    """The subcommand ``name`` of the subparsers ``sub``, carried out by ``run``: ``summary``
    in the list of commands, ``about`` atop its help, ``epilog`` (laid out as written) below."""
    p = sub.add_parser(
        name,
        help=summary,
        description=about,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.set_defaults(func=run)
    return p


def _stage(args: argparse.Namespace) -> int:
    """``datastore stage``: here, or by a running service (``--service``)."""
    if args.service is not None:
        from datastore.service.stage_client import run_remote

        return run_remote(args)
    return stage_cli.run(args)


def negatives_joined(argv: list[str]) -> list[str]:
    """``argv`` with each ``--option -5G`` as ``--option=-5G``: argparse takes a value that
    starts with ``-`` and is not a plain number for an option, and answered a negative size
    with 'expected one argument' where the option's type says what is wrong with it."""
    out: list[str] = []
    for arg in argv:
        last = out[-1] if out else ""
        if last.startswith("--") and last != "--" and "=" not in last and _NEGATIVE.match(arg):
            out[-1] = f"{last}={arg}"
        else:
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    whole_lines()
    grpc_errors_only()
    try:
        args = parser().parse_args(negatives_joined(sys.argv[1:] if argv is None else argv))
    except SystemExit as stop:  # a usage error (2, its line said), --help or --version (0)
        return int(stop.code or 0)
    try:
        code = args.func(args)
        sys.stdout.flush()  # (a reader gone is seen here, not at the interpreter's exit)
        if code and isinstance(code, Agreed):  # every rank ends here alike: no MPI_Abort
            finalize_mpi()
        return code
    except KeyboardInterrupt:
        print("datastore: interrupted", file=sys.stderr)
        return Exit.INTERRUPTED
    except Exception as exc:  # the last line of defence: one line, and no rank left hanging
        if isinstance(exc, BrokenPipeError) and reader_gone():  # quietly, as `cat` ends
            _abort_peers(Exit.READER_GONE)
            return Exit.READER_GONE
        if os.environ.get("DATASTORE_DEBUG"):
            traceback.print_exc()
        print(
            f"datastore {args.command}: internal error: {type(exc).__name__}: {exc} "
            "(set DATASTORE_DEBUG=1 for the traceback)",
            file=sys.stderr,
        )
        _abort_peers()
        return Exit.FAILED


def _abort_peers(code: Exit = Exit.FAILED) -> None:
    """Under MPI, take every other rank down with this one rather than leave them waiting."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and mpi.COMM_WORLD.Get_size() > 1:
        sys.stderr.flush()
        mpi.COMM_WORLD.Abort(code)


if __name__ == "__main__":
    sys.exit(main())
