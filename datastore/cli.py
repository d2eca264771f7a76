"""The ``datastore`` command: one entry point, a subcommand per job."""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from datastore import plan_cmd
from datastore._version import __version__
from datastore.readers import inspect_cmd
from datastore.service import cli as service_cli
from staging import cli as stage_cli
from staging.exitcodes import Exit

__all__ = ["main"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="datastore",
        description="Stage datasets to node-local storage and feed them to distributed trainers.",
    )
    p.add_argument("--version", action="version", version=f"datastore {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    stage_cli.add_parser(sub)
    sub.choices["stage"].set_defaults(func=_stage)
    inspect_cmd.add_parser(sub)
    plan_cmd.add_parser(sub)
    service_cli.add_parser(sub)
    return p


def _stage(args: argparse.Namespace) -> int:
    """``datastore stage``: here, or by a running service (``--service``)."""
    if args.service is not None:
        from datastore.service.stage_client import run_remote

        return run_remote(args)
    return stage_cli.run(args)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("datastore: interrupted", file=sys.stderr)
        return Exit.INTERRUPTED
    except Exception as exc:  # the last line of defence: one line, and no rank left hanging
        if os.environ.get("DATASTORE_DEBUG"):
            traceback.print_exc()
        print(
            f"datastore {args.command}: internal error: {type(exc).__name__}: {exc} "
            "(set DATASTORE_DEBUG=1 for the traceback)",
            file=sys.stderr,
        )
        _abort_peers()
        return Exit.FAILED


def _abort_peers() -> None:
    """Under MPI, take every other rank down with this one rather than leave them waiting."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and mpi.COMM_WORLD.Get_size() > 1:
        sys.stderr.flush()
        mpi.COMM_WORLD.Abort(Exit.FAILED)


if __name__ == "__main__":
    sys.exit(main())
