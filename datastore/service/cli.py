"""The ``datastore serve`` and ``datastore status`` subcommands."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "format_status", "status_dict"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

SERVE_EPILOG = """\
The socket's directory is created 0700 if missing, the socket is 0600. A socket left by a
server that died is removed on the next start; a path served by a live server is refused.
Logs: one JSON object per line on stderr. SIGTERM, SIGINT or the Shutdown call drain the
calls in flight and exit 0, removing the socket (and its directory if serve created it).

exit codes:
  0  stopped cleanly
  1  could not listen (a live server holds the socket, an unsafe directory, a busy port)
  2  bad usage (--tcp without --token-file, an unreadable or empty token file)

examples:
  datastore serve
  datastore serve --socket /l/ssd/run/datastore.sock
  datastore serve --tcp 0.0.0.0:7433 --token-file ~/.datastore-token
"""

STATUS_EPILOG = """\
exit codes:
  0  the service answered
  1  no service answers (one line on stderr)

examples:
  datastore status
  datastore status --socket /l/ssd/run/datastore.sock --json
"""


def add_parser(sub: Any) -> None:
    """Register ``serve`` and ``status`` on the ``datastore`` subparsers ``sub``."""
    from datastore.service.paths import default_socket

    default = default_socket()
    p = sub.add_parser(
        "serve",
        help="run the node data service (gRPC on a private Unix socket)",
        description="Run the node-local data service: gRPC (datastore.v1.DataStore, health "
        "checking, reflection) on a private Unix socket, and optionally on TCP with a shared "
        "secret.",
        epilog=SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--socket", type=Path, default=None, help=f"Unix socket path (default: {default})"
    )
    p.add_argument(
        "--tcp",
        metavar="HOST:PORT",
        default=None,
        help="also listen on TCP (port 0: any free port); needs --token-file",
    )
    p.add_argument(
        "--token-file",
        type=Path,
        default=None,
        help="file holding the shared secret every TCP call must carry",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="how long shutdown lets calls in flight finish (default: 5)",
    )
    p.add_argument("--workers", type=int, default=8, help="threads serving calls (default: 8)")
    p.add_argument(
        "--allow",
        type=Path,
        action="append",
        default=[],
        metavar="PATH",
        help="Stage reads and writes only under PATH (repeatable; default: anywhere)",
    )
    p.set_defaults(func=run_serve)

    s = sub.add_parser(
        "status",
        help="show what a running `datastore serve` holds and has served",
        description="Ask a running `datastore serve` for its status.",
        epilog=STATUS_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument(
        "--socket", type=Path, default=None, help=f"Unix socket path (default: {default})"
    )
    s.add_argument("--tcp", metavar="HOST:PORT", default=None, help="ask over TCP instead")
    s.add_argument("--token-file", type=Path, default=None, help="the secret for --tcp")
    s.add_argument(
        "--timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="how long to wait for an answer (default: 5)",
    )
    s.add_argument("--json", action="store_true", help="print the reply as JSON")
    s.set_defaults(func=run_status)


def run_serve(args: argparse.Namespace) -> int:
    from datastore.service.paths import default_socket
    from datastore.service.server import ServeConfig, serve

    private = args.socket is None
    try:
        config = ServeConfig(
            socket=default_socket() if private else args.socket,
            private=private,
            tcp=args.tcp,
            token_file=args.token_file,
            grace_s=args.grace,
            workers=args.workers,
            allowed_roots=tuple(args.allow),
        )
    except ValueError as exc:
        print(f"datastore serve: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return serve(config)


def run_status(args: argparse.Namespace) -> int:
    import grpc

    from datastore.service.auth import read_token
    from datastore.service.client import Client
    from datastore.service.paths import default_socket

    token = None
    if args.token_file is not None:
        try:
            token, _ = read_token(args.token_file)
        except (OSError, ValueError) as exc:
            print(f"datastore status: cannot use token file: {exc}", file=sys.stderr)
            return EXIT_USAGE
    socket = args.socket or default_socket()
    with Client(socket, tcp=args.tcp, token=token, timeout_s=args.timeout) as client:
        try:
            reply = client.status()
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                msg = (
                    f"no service answers at {client.target}: {code.name} "
                    "(is `datastore serve` running? start it, or pass --socket)"
                )
            else:
                details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
                msg = f"the service at {client.target} refused: {code.name}: {details}"
            print(f"datastore status: {msg}", file=sys.stderr)
            return EXIT_FAILED
    d = status_dict(reply)
    print(json.dumps(d, indent=2) if args.json else format_status(d))
    return EXIT_OK


def status_dict(reply: Any) -> dict[str, Any]:
    """The ``Status`` reply as plain JSON-able data (field names as in the protocol)."""
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(
        reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def format_status(d: dict[str, Any]) -> str:
    """The status as a small table for people."""
    from staging.progress import human_bytes

    rows = [
        ("service", f"datastore {d['version']}, pid {d['pid']}, up {float(d['uptime_s']):.1f} s"),
        ("listen", ", ".join(d["listen"]) or "-"),
        ("datasets", str(len(d["datasets"]))),
        ("sessions", str(len(d["sessions"]))),
        ("clients", str(d["clients"])),
        (
            "served",
            f"{int(d['batches_served'])} batches, "
            f"{human_bytes(int(d['bytes_served']))}, {int(d['calls_served'])} calls",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    if d["datasets"]:
        lines += ["", f"{'dataset':<40} {'format':<8} {'samples':>10} {'resident':>12}"]
        lines += [
            f"{x['path']:<40} {x['format']:<8} {int(x['num_samples']):>10} "
            f"{human_bytes(int(x['bytes_resident'])):>12}"
            for x in d["datasets"]
        ]
    if d["sessions"]:
        lines += [
            "",
            f"{'session':<20} {'job':<12} {'world':>6} {'batch':>6} {'batches':>9} "
            f"{'bytes':>10}  dataset",
        ]
        lines += [
            f"{x['session_id']:<20} {x['job_id'] or '-':<12} {x['world_size']:>6} "
            f"{x['global_batch']:>6} {int(x['batches_served']):>9} "
            f"{human_bytes(int(x['bytes_served'])):>10}  {x['dataset_path']}"
            for x in d["sessions"]
        ]
    return "\n".join(lines)
