"""What the ``datastore serve``, ``status``, ``load``, ``unload`` and ``shutdown`` subcommands do,
given their parsed arguments (:mod:`datastore.service.cli` parses them); each returns the exit
code and says why it failed in one line on stderr."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from datastore.service.status_table import format_status, status_dict
from staging.exitcodes import Exit

__all__ = ["run_load", "run_serve", "run_shutdown", "run_status", "run_unload"]


def run_serve(args: argparse.Namespace) -> int:
    from datastore.service.config import ServeConfig
    from datastore.service.grpc_peers import parse_peers
    from datastore.service.paths import default_socket, default_state_file
    from datastore.service.server import serve

    private = args.socket is None
    socket = default_socket() if private else args.socket
    try:
        derived = {  # the settings the options do not give as they are
            "socket": socket,
            "private": private,
            "state_file": args.state_file or default_state_file(socket),
            "allowed_roots": tuple(args.allow),
            "peers": parse_peers(args.peers) if args.peers else (),
        }
        names = {f.name for f in dataclasses.fields(ServeConfig)} - derived.keys()
        # the other options are stored under their ServeConfig field's name (service.cli)
        config = ServeConfig(**derived, **{k: v for k, v in vars(args).items() if k in names})
    except ValueError as exc:
        print(f"datastore serve: {exc}", file=sys.stderr)
        return Exit.BAD_INPUT
    return serve(config)


def _ask(args: argparse.Namespace, command: str, call: Callable[[Any], Any]) -> tuple[Any, int]:
    """``(call(client), 0)`` on the service ``args`` name, or ``(None, exit code)`` once the
    reason it failed is printed (one line on stderr)."""
    import grpc

    from datastore.errors import DataStoreError
    from datastore.service.auth import read_token
    from datastore.service.client import Client
    from datastore.service.paths import service_address

    token = None
    if args.token_file is not None:
        try:
            token, _ = read_token(args.token_file)
        except (OSError, ValueError) as exc:
            print(f"datastore {command}: cannot use token file: {exc}", file=sys.stderr)
            return None, Exit.BAD_INPUT
    try:
        address = service_address(args.address)
    except ValueError as exc:
        print(f"datastore {command}: {exc}", file=sys.stderr)
        return None, Exit.FAILED
    try:
        client = Client(address, token=token, timeout_s=args.timeout, tls_ca=args.tls_ca)
    except OSError as exc:
        print(f"datastore {command}: cannot read --tls-ca: {exc}", file=sys.stderr)
        return None, Exit.BAD_INPUT
    except ValueError as exc:  # an address gRPC would misread (a port over 65535)
        print(f"datastore {command}: {exc}", file=sys.stderr)
        return None, Exit.BAD_INPUT
    with client:
        try:
            return call(client), Exit.OK
        except (DataStoreError, ValueError) as exc:
            code = getattr(exc, "grpc_status", None)  # set by raise_for: the call failed
            if code is None:
                raise
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                tls = args.tls_ca is not None
                msg = unreachable(
                    client.target, code.name, exc.grpc_details, tls, timeout_s=args.timeout
                )
            else:
                msg = f"the service at {client.target} refused: {code.name}: {exc.grpc_details}"
            print(f"datastore {command}: {msg}", file=sys.stderr)
            return None, Exit.FAILED


def unreachable(
    target: str,
    code: str,
    details: str,
    tls: bool,
    flag: str = "--address",
    timeout_s: float | None = None,
) -> str:
    """Why no service answered at ``target``: a TLS handshake that failed, with gRPC's reason
    (a wrong CA, a service without TLS); no answer within ``timeout_s`` (a service stopped
    with SIGSTOP was told to "start it"); else whether it runs (``flag`` names another), and
    over TCP without TLS (``tls``: ``--tls-ca`` given) that a service with a certificate needs
    one (it just closes the socket)."""
    if "handshake" in details.lower():
        return f"no TLS connection to {target}: {details}"
    if "permission denied" in details.lower():  # (it said: is `datastore serve` running?)
        return (
            f"no access to {target}: permission denied (a socket of another user's service: "
            f"start your own, or pass {flag})"
        )
    if code == "DEADLINE_EXCEEDED":
        within = f" within {timeout_s:g} s" if timeout_s else ""
        host = "" if target.startswith("unix:") else ", or its host is unreachable"
        return (
            f"the service at {target} did not answer{within}: it may be hung{host} "
            "(--timeout waits longer)"
        )
    hint = f"is `datastore serve` running? start it, or pass {flag}"
    if not tls and not target.startswith("unix:"):
        hint += "; a service started with --tls-cert needs --tls-ca"
    return f"no service answers at {target}: {code} ({hint})"


def run_status(args: argparse.Namespace) -> int:
    reply, code = _ask(args, "status", lambda c: c.status())
    if reply is None:
        return code
    d = status_dict(reply)
    print(json.dumps(d, indent=2) if args.json else format_status(d))
    return Exit.OK


def run_load(args: argparse.Namespace) -> int:
    from staging.progress import human_bytes

    if _unsendable("load", args.path):
        return Exit.BAD_INPUT
    if args.timeout is None:
        args.timeout = None if args.wait else 5.0
    reply, code = _ask(args, "load", lambda c: c.load(_absolute(args.path), wait=args.wait))
    if reply is None:
        return code
    x = reply.dataset
    state = "loading" if x.loading else "resident"
    print(
        f"{x.path}: {state}, {human_bytes(x.bytes_resident)} of {human_bytes(x.bytes_total)} "
        f"in memory, {x.num_samples} samples"
    )
    return Exit.OK


def run_unload(args: argparse.Namespace) -> int:
    from staging.progress import human_bytes

    if _unsendable("unload", args.path):
        return Exit.BAD_INPUT
    reply, code = _ask(args, "unload", lambda c: c.unload(_absolute(args.path)))
    if reply is None:
        return code
    print(f"{args.path}: unloaded, {human_bytes(reply.bytes_freed)} freed")
    return Exit.OK


def run_shutdown(args: argparse.Namespace) -> int:
    def stop(client: Any) -> tuple[Any, bool]:
        pid = client.status().pid
        client.shutdown(grace_s=args.grace, reason=args.reason)
        return pid, _stopped(client, (args.grace or 60.0) + 30.0)

    reply, code = _ask(args, "shutdown", stop)
    if reply is None:
        return code
    pid, stopped = reply
    if not stopped:
        print(f"datastore shutdown: the service (pid {pid}) still answers", file=sys.stderr)
        return Exit.FAILED
    print(f"datastore serve (pid {pid}) stopped")
    return Exit.OK


def _stopped(client: Any, wait_s: float) -> bool:
    """Whether the service stops within ``wait_s`` seconds: it no longer answers ``client``
    and, on a Unix socket, no longer holds the socket's lock (its process ended: the socket
    itself goes as the drain begins)."""
    from datastore.errors import DataStoreError
    from datastore.service.paths import socket_held

    target = client.target
    sock = (
        Path(target.removeprefix("unix://").removeprefix("unix:"))
        if target.startswith("unix:")
        else None
    )
    deadline = time.monotonic() + wait_s
    answering = True
    while time.monotonic() < deadline:
        if answering:
            try:
                client.status()
            except (DataStoreError, ValueError):
                answering = False
        if not answering and (sock is None or not socket_held(sock)):
            return True
        time.sleep(0.1)
    return False


def _absolute(path: str) -> str:
    """A path as the service wants it: absolute (a relative one is from here)."""
    return os.path.abspath(path)


def _unsendable(command: str, path: str) -> bool:
    """Say so (exit 2) when ``path`` cannot travel in a request: the protocol's strings are
    UTF-8, and a file name of other bytes reaches Python as lone surrogates."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        print(f"datastore {command}: {path!r}: not a UTF-8 path, which the service cannot be sent",
              file=sys.stderr)  # fmt: skip
        return True
    return False
