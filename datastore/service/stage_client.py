"""``datastore stage --service``: hand the stage to a running ``datastore serve``.

The sources and DEST are sent as absolute paths and staged by the service on its node, as
``datastore stage`` would there; this process shows the progress the service streams (a bar
on a terminal, JSON lines with ``--progress-json``), prints the summary and exits with the
stage's exit code. Ctrl-C cancels the call, and the service kills the stage (which leaves
nothing half-written: a later stage resumes it).
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from typing import Any

from staging.exitcodes import Exit

__all__ = ["UNSUPPORTED", "run_remote"]

# options of `datastore stage` the service request does not carry: (dest, default)
UNSUPPORTED = {
    "mode": "replicate",
    "checksum": "xxh3",
    "io": "auto",
    "dry_run": False,
    "ranks_per_node": None,
    "confine": [],  # the service confines every stage to its own --allow roots
    "preserve_special_bits": False,  # the service always drops them
}


def _fail(msg: str, code: int) -> int:
    print(f"datastore stage: {msg}", file=sys.stderr)
    return code


def run_remote(args: argparse.Namespace) -> int:
    """Send the stage of ``args`` to the service at ``args.service``; returns the exit code."""
    import grpc

    from datastore.service._pb.v1 import datastore_pb2 as pb
    from datastore.service._pb.v1 import datastore_pb2_grpc as pb_grpc
    from datastore.service.auth import bearer, read_token
    from datastore.service.client import open_channel, target_of
    from datastore.service.commands import unreachable
    from datastore.service.paths import service_address

    bad = ["--" + k.replace("_", "-") for k, v in UNSUPPORTED.items() if getattr(args, k) != v]
    if bad:
        return _fail(f"error: --service does not take {', '.join(bad)}", Exit.BAD_INPUT)
    try:
        address = service_address(args.service, "--service")
    except ValueError as exc:
        return _fail(str(exc), Exit.FAILED)
    if os.path.exists(address) and not stat.S_ISSOCK(os.stat(address).st_mode):
        return _fail(
            f"error: --service {address}: not a socket (did it take a SRC? put --service "
            "after the sources, or write --service=ADDRESS)",
            Exit.BAD_INPUT,
        )
    if not args.sources:
        return _fail("error: --service needs at least one SRC to stage", Exit.BAD_INPUT)
    token = None
    if args.token_file is not None:
        try:
            token, _ = read_token(args.token_file)
        except (OSError, ValueError) as exc:
            return _fail(f"error: cannot use token file: {exc}", Exit.BAD_INPUT)
    request = pb.StageRequest(
        sources=[os.path.abspath(s) for s in args.sources],
        dest=os.path.abspath(args.dest),
        verify=args.verify,
        unpack=not args.no_unpack,
        streams=args.streams,
        load=args.load,
    )
    target = target_of(address)
    tls_ca = None if target.startswith("unix:") else args.tls_ca
    try:
        channel = open_channel(target, tls_ca)
    except OSError as exc:
        return _fail(f"error: cannot read --tls-ca: {exc}", Exit.BAD_INPUT)
    with channel:
        call = pb_grpc.DataStoreStub(channel).Stage(
            request, metadata=bearer(token) if token else None
        )
        try:
            last = _show(call, args)
        except KeyboardInterrupt:
            call.cancel()
            return _fail("interrupted; the service stops the stage", Exit.INTERRUPTED)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                tls = tls_ca is not None
                why = unreachable(target, code.name, details or "", tls, "--service ADDRESS")
                return _fail(why, Exit.FAILED)
            usage = code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED)
            return _fail(
                f"the service at {target} refused: {code.name}: {details}",
                Exit.BAD_INPUT if usage else Exit.FAILED,
            )
    if last is None:
        return _fail(f"the service at {target} ended the stage without a result", Exit.FAILED)
    _report(last, args)
    return last.exit_code


def _show(call: Any, args: argparse.Namespace) -> Any:
    """Show the progress messages of ``call``; the last (``done``) message, or None."""
    from staging.progress import Progress

    as_json = args.progress_json
    bar_on = not (args.json or args.quiet or as_json) and sys.stderr.isatty()
    bar: Progress | None = None
    last = None
    try:
        for msg in call:  # read to the end, so the service finishes the call cleanly
            if msg.done:
                if bar is not None:
                    bar.advance(msg.bytes_done - bar.done)
                last = msg
                continue
            if bar is None and (as_json or bar_on):
                bar = Progress(msg.bytes_total, enabled=bar_on, json_lines=as_json).__enter__()
            if bar is not None:
                bar.advance(msg.bytes_done - bar.done)
        return last
    finally:
        if bar is not None:
            bar.__exit__(None, None, None)


def _report(last: Any, args: argparse.Namespace) -> None:
    """Print what ``datastore stage`` would have printed, from the ``done`` message."""
    from staging.stage import summary_line

    if last.message:
        print(last.message, file=sys.stderr)
    if not last.summary_json:
        return
    if args.json or args.progress_json:
        print(last.summary_json, flush=True)
        return
    doc = json.loads(last.summary_json)
    for e in doc.get("errors", []):
        print(f"datastore stage: error: {e}", file=sys.stderr)
    if not args.quiet:
        print(summary_line(doc))
        ver = doc.get("verify")
        if ver is not None:
            print(f"verified {ver['verified']} entries: {len(ver['problems'])} problem(s)")
