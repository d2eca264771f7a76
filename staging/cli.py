"""The ``datastore stage`` command line."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from staging.config import MODES, StageConfig, default_streams
from staging.console import path_arg, whole
from staging.directio import IO_MODES
from staging.exitcodes import Agreed, Exit

__all__ = ["add_parser", "run", "whole"]

EPILOG = """\
exit codes:
  0  everything staged (or verified) as asked
  1  staging failed: an I/O error (a file inside a source that cannot be read, or changed
     while copied, included), a destination locked by another run, or a failed rank
  2  bad input: usage error, a SRC that is missing or cannot be read or listed, an unsafe or
     corrupt archive (the other sources are still staged)
  3  not enough free space in DEST (checked before anything is placed there)
  4  --verify found missing or changed files
  with --service: the stage's code; 1 also when no service answers or none is named, 2 when
  it refuses the request (a path outside its --allow roots), 130 on Ctrl-C (the service
  stops the stage)

examples:
  datastore stage /lustre/proj/cosmo.tar.zst /lustre/proj/labels --to /l/ssd/cosmo
  mpiexec -n 8 datastore stage /gpfs/ds --to /l/ssd/ds --mode shard
  datastore stage --verify --to /l/ssd/cosmo
  datastore stage /lustre/proj/cosmo.tar.zst --to /l/ssd/cosmo --service
"""


def _default_streams_text() -> str:
    """The default for ``--help``: a bad ``DATASTORE_STREAMS`` is reported when staging."""
    try:
        return str(default_streams())
    except ValueError:
        return "4 per core"


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "stage",
        help="copy and unpack datasets to node-local storage: parallel, verified, resumable",
        description="Copy files, directories and tar archives (.tar, .tar.gz/.tgz, .tar.zst) "
        "from a parallel filesystem to node-local storage. Archives are unpacked into DEST. "
        "Under mpiexec or srun the ranks of a node share the work, and every node gets the "
        "dataset (--mode replicate) or a byte-balanced share of it (--mode shard).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "sources",
        type=path_arg,
        nargs="*",
        metavar="SRC",
        help="files, directories (as DEST/NAME, also written SRC/ or SRC/.) or tar archives",
    )
    p.add_argument(
        "--to",
        type=path_arg,
        dest="dest",
        required=True,
        metavar="DEST",
        help="destination directory; '{node}' in it becomes the node index",
    )
    p.add_argument(
        "--streams",
        type=whole,
        default=0,
        metavar="N",
        help=f"parallel I/O streams per rank (default here: {_default_streams_text()})",
    )
    p.add_argument("--no-unpack", action="store_true", help="copy archives as they are")
    p.add_argument(
        "--mode",
        choices=MODES,
        default="replicate",
        help="replicate: every node gets everything (default); shard: node k of K "
        "gets a byte-balanced k-th share, recorded in the manifest",
    )
    p.add_argument(
        "--checksum",
        choices=("xxh3", "blake2b", "none"),
        default="xxh3",
        help="hash computed while copying (default xxh3); 'none': no hash, and --verify "
        "then checks sizes only",
    )
    p.add_argument(
        "--io",
        choices=IO_MODES,
        default="auto",
        help="auto (default): the kernel copies files through the page cache (splice), "
        "writeback started as each piece lands; an uncompressed tar on a local disk is read "
        "with O_DIRECT unless it is in the page cache already; direct: O_DIRECT for every "
        "read and write; buffered: never O_DIRECT",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="list what would be copied, the bytes, and an estimated time",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="re-hash DEST against its manifest (with SRC: after staging)",
    )
    p.add_argument(
        "--ranks-per-node",
        type=whole,
        default=None,
        metavar="N",
        help="group ranks into nodes by rank // N instead of by shared memory",
    )
    p.add_argument(
        "--preserve-special-bits",
        action="store_true",
        help="keep setuid, setgid and sticky bits of source files and archive members (default: "
        "dropped, so that staging never creates a setuid program)",
    )
    p.add_argument(
        "--confine",
        type=path_arg,
        action="append",
        default=[],
        metavar="ROOT",
        help="read only files that resolve beneath ROOT (repeatable): a source outside, or a "
        "symlink inside a source tree that leads out, is skipped with an error "
        "(`datastore serve --allow` passes its roots)",
    )
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument(
        "--progress-json",
        action="store_true",
        help='print progress as JSON lines on stdout ({"event": "progress", "bytes_done": N, '
        '"bytes_total": M}, at most every 0.25 s and at the end), then the --json summary',
    )
    p.add_argument(
        "--service",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="hand the stage to a running `datastore serve` and stream its progress; ADDRESS: "
        "a socket path or HOST:PORT (default: $DATASTORE_ADDRESS, else the default socket). "
        "Put it after the sources, or write --service=ADDRESS",
    )
    p.add_argument(
        "--token-file",
        type=path_arg,
        default=None,
        metavar="PATH",
        help="the shared secret of a service reached over TCP (--service HOST:PORT)",
    )
    p.add_argument(
        "--tls-ca",
        type=path_arg,
        default=None,
        metavar="PEM",
        help="the certificate to check a TLS service against (--service HOST:PORT of a service "
        "started with --tls-cert)",
    )
    p.add_argument(
        "--load",
        action="store_true",
        help="with --service: once staged, make it resident in that service (each directory "
        "source as DEST/NAME, DEST itself for files and archives)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar and no summary")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Stage here (``--service`` is handed to the service by ``datastore.cli``)."""
    about_the_service = (
        ("--load", args.load),
        ("--token-file", args.token_file is not None),
        ("--tls-ca", args.tls_ca is not None),
    )
    for flag, given in about_the_service:
        if given:
            print(
                f"datastore stage: error: {flag} needs --service (it is about the service)",
                file=sys.stderr,
            )
            return Exit.BAD_INPUT
    try:
        cfg = StageConfig(
            dest=args.dest,
            sources=tuple(args.sources),
            streams=args.streams,
            unpack=not args.no_unpack,
            mode=args.mode,
            checksum=args.checksum,
            io=args.io,
            dry_run=args.dry_run,
            verify=args.verify,
            json=args.json,
            progress_json=args.progress_json,
            quiet=args.quiet,
            ranks_per_node=args.ranks_per_node,
            preserve_special_bits=args.preserve_special_bits,
            confine=tuple(args.confine),
        )
    except ValueError as exc:
        print(f"datastore stage: error: {exc}", file=sys.stderr)
        return Exit.BAD_INPUT
    from staging.cluster import world
    from staging.launcher import LaunchMismatch

    try:
        comm = world()
    except LaunchMismatch as exc:
        print(f"datastore stage: error: {exc}", file=sys.stderr)
        return Agreed(Exit.BAD_INPUT)  # (each process in a world of its own)
    if cfg.dry_run:  # node 0's plan (its share in shard mode), what every node would refuse
        from staging.cluster import layout
        from staging.dryrun import dry_run, node_refusal

        lay, _ = layout(comm, cfg.ranks_per_node)
        mine = node_refusal(cfg, lay.node, lay.nodes) if lay.is_leader and lay.node else None
        others = [e for e in comm.gather(mine) or () if e]
        code = dry_run(cfg, lay.node, lay.nodes, others) if lay.rank == 0 else None
        return Agreed(comm.bcast(code))
    code = Exit.OK
    if cfg.sources:
        from staging.stage import stage

        code = stage(cfg, comm)
    if cfg.verify and code == Exit.OK:
        from staging.verify import verify_command

        code = verify_command(cfg, comm)
    return code
