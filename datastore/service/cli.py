"""The ``datastore serve``, ``status``, ``load``, ``unload`` and ``shutdown`` subcommands: their
arguments, help and checks of values; what each does is :mod:`datastore.service.commands`."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from datastore.service.commands import run_load, run_serve, run_shutdown, run_status, run_unload
from datastore.service.config import MAX_GRACE_S, MAX_PEER_TIMEOUT_S, ServeConfig
from datastore.store.memory import parse_size
from staging.console import option_type, path_arg

__all__ = ["add_parser", "parse_bytes"]

# serve's defaults are ServeConfig's; an option of serve is stored under its field's name
SERVE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ServeConfig)}


SERVE_EPILOG = """\
The socket's directory (not its parents) is created 0700 if missing, the socket is 0600. A
socket left by a server that died is removed on the next start; a path served by a live
server is refused.
Logs: one JSON object per line on stderr. SIGTERM, SIGINT or the Shutdown call drain the
calls in flight and exit 0, removing the socket (and its directory if serve created it).

exit codes:
  0  stopped cleanly
  1  could not listen (a live server holds the socket, an unsafe or missing directory, a
     busy port)
  2  bad usage (--tcp without --token-file, an unreadable or empty token file, or one that
     others can read, an --allow root that does not exist, a --state-file that is a directory,
     a value of a numeric option that is not a number or out of its range: one line naming it)

examples:
  datastore serve
  datastore serve --socket /l/ssd/run/datastore.sock
  datastore serve --tcp 0.0.0.0:7433 --token-file ~/.datastore-token
  datastore serve --tcp 0.0.0.0:7433 --token-file SECRET --tls-cert cert.pem --tls-key key.pem
  datastore serve --memory-budget 64G --allow /l/ssd --metrics 0.0.0.0:9433
  mpiexec -n 4 -ppn 1 python -m mpi4py -m datastore serve      # one store over 4 nodes (MPICH)
  mpiexec -n 4 -N 1 python -m mpi4py -m datastore serve        # the same, Open MPI's mpiexec
  (Open MPI refuses more ranks than cores on one machine: add --oversubscribe)
  datastore serve --tcp 0.0.0.0:7433 --token-file SECRET \\
      --peers n0:7433,n1:7433,n2:7433 --node 1                # one store, peering over gRPC
"""

ADDRESS_NOTE = """\
The service is --address (or --socket/--tcp), else $DATASTORE_ADDRESS, else the default socket
when one is there; with none of them the command says so and exits 1.
"""

STATUS_EPILOG = f"""\
{ADDRESS_NOTE}
exit codes:
  0  the service answered
  1  no service answers, or none is named (one line on stderr)

examples:
  datastore status
  datastore status --address /l/ssd/run/datastore.sock --json
  DATASTORE_ADDRESS=n0:7433 datastore status --token-file ~/.datastore-token
"""

LOAD_EPILOG = f"""\
The dataset stays resident across jobs until it is unloaded or evicted (least recently used
first, never while a session uses it) to make room under the service's memory budget.
{ADDRESS_NOTE}
exit codes:
  0  the dataset is resident (or being read in, without --wait)
  1  no service answers or none is named, or it refused (one line on stderr: no such
     dataset, outside the allowed roots, not a dataset...)

examples:
  datastore load /l/ssd/run/train.h5
  datastore load /l/ssd/run/train.h5 --wait --address /l/ssd/run/datastore.sock
"""

UNLOAD_EPILOG = f"""\
{ADDRESS_NOTE}
exit codes:
  0  the dataset was dropped from memory
  1  no service answers or none is named, or it refused (one line on stderr: not resident,
     used by an open session...)

examples:
  datastore unload /l/ssd/run/train.h5
"""


SHUTDOWN_EPILOG = f"""\
The service stops accepting calls, lets those in flight finish for up to --grace seconds (0:
its own --grace), ends the open streams, removes its socket and exits 0. This command waits
until the service no longer answers: at most the grace plus 30 s (60 s plus 30 with --grace 0).
Over TCP the call carries the token (--token-file), as every call does.
{ADDRESS_NOTE}
exit codes:
  0  the service stopped
  1  no service answers or none is named, it refused, or it still answers after the wait
  2  bad usage (--grace outside 0..3600, an unreadable token file)

examples:
  datastore shutdown
  datastore shutdown --socket /l/ssd/run/datastore.sock --grace 30
  datastore shutdown --tcp n0:7433 --token-file ~/.datastore-token
"""


def add_parser(command: Callable[..., argparse.ArgumentParser]) -> None:
    """Register ``serve``, ``status``, ``load``, ``unload`` and ``shutdown`` through
    ``command(name, run, summary, about, epilog)``, ``datastore.cli``'s subcommand builder."""
    from datastore.service.paths import default_socket

    default = default_socket()
    p = command(
        "serve",
        run_serve,
        "run the node data service (gRPC on a private Unix socket)",
        "Run the node-local data service: gRPC (datastore.v1.DataStore, health "
        "checking, reflection) on a private Unix socket, and optionally on TCP with a shared "
        "secret.",
        SERVE_EPILOG,
    )
    p.add_argument(
        "--socket", type=_path, default=None, help=f"Unix socket path (default: {default})"
    )
    p.add_argument(
        "--tcp",
        metavar="HOST:PORT",
        default=None,
        help="also listen on TCP (port 0: any free port); needs --token-file",
    )
    p.add_argument(
        "--token-file",
        type=_path,
        default=None,
        help="file holding the shared secret every TCP call must carry",
    )
    p.add_argument("--tls-cert", type=_path, default=None, help="PEM certificate: TCP over TLS")
    p.add_argument("--tls-key", type=_path, default=None, help="PEM private key of --tls-cert")
    what = "how long shutdown lets calls in flight finish"
    _seconds_option(p, "--grace", "grace_s", what, _grace)
    p.add_argument(
        "--workers",
        type=_whole(1),
        default=SERVE_DEFAULTS["workers"],
        help="threads serving calls, one per call in flight (each rank's stream holds one for "
        "its life); a call beyond them is refused RESOURCE_EXHAUSTED (default: %(default)s)",
    )
    p.add_argument(
        "--memory-budget",
        type=option_type(parse_bytes, "--memory-budget"),
        default=None,
        metavar="SIZE",
        help="memory for resident datasets, e.g. 64G (default: no limit); least recently used "
        "datasets no session uses are evicted to make room",
    )
    p.add_argument(
        "--allow",
        type=_path,
        action="append",
        default=[],
        metavar="DIR",
        help="serve datasets (and stage) only under DIR; repeatable (default: anywhere)",
    )
    p.add_argument(
        "--state-file",
        type=_path,
        default=None,
        help="where resident datasets are listed, to reload them after a restart "
        "(default: under $XDG_STATE_HOME/datastore, one per socket)",
    )
    what = "close a session with no stream for this long: its client died"
    _seconds_option(p, "--session-idle", "session_idle_s", what, _seconds)
    p.add_argument(
        "--metrics",
        metavar="HOST:PORT",
        default=None,
        help="serve Prometheus metrics on http://HOST:PORT/metrics (port 0: any free port)",
    )
    p.add_argument(
        "--peers",
        metavar="HOST:PORT,...",
        default=None,
        help="every service of the store, this one included, in node order: the services "
        "peer over gRPC on their --tcp addresses, with the same --token-file (not under mpiexec)",
    )
    p.add_argument("--node", type=_whole(0), default=None, help="this service's index in --peers")
    p.add_argument(
        "--peer-ca",
        type=_path,
        default=None,
        help="PEM certificate(s) to check the peers' TLS against (default: --tls-cert)",
    )
    what = "how long a request to a peer waits for it before failing"
    peer_timeout = functools.partial(_seconds, most=MAX_PEER_TIMEOUT_S)
    _seconds_option(p, "--peer-timeout", "peer_timeout_s", what, peer_timeout)
    p.add_argument(
        "--data-port",
        type=_whole(0, 65535),
        default=SERVE_DEFAULTS["data_port"],
        metavar="PORT",
        help="with --peers: the port of the peers' data connections, on the host of --tcp "
        "(default: 0, any free port; a firewall between nodes must open it too, else the "
        "blocks come over gRPC, slower)",
    )

    s = command(
        "status",
        run_status,
        "show what a running `datastore serve` holds and has served",
        "Ask a running `datastore serve` for its status: resident datasets, "
        "jobs and their sessions, totals.",
        STATUS_EPILOG,
    )
    _client_options(s, default)
    s.add_argument("--json", action="store_true", help="print the whole reply as JSON")

    ld = command(
        "load",
        run_load,
        "make a dataset resident in a running `datastore serve`",
        "Ask a running `datastore serve` to read a dataset into memory now (what "
        "the first session on it does otherwise).",
        LOAD_EPILOG,
    )
    what = "the dataset on the service's node (a relative path is from here)"
    ld.add_argument("path", type=path_arg, help=what)
    ld.add_argument("--wait", action="store_true", help="return once every sample is in memory")
    _client_options(ld, default, timeout=None)

    un = command(
        "unload",
        run_unload,
        "drop a resident dataset from a running `datastore serve`",
        "Ask a running `datastore serve` to drop a resident dataset that no open session uses.",
        UNLOAD_EPILOG,
    )
    un.add_argument("path", type=path_arg, help="the dataset, as it was loaded")
    _client_options(un, default)

    sd = command(
        "shutdown",
        run_shutdown,
        "stop a running `datastore serve` (drain, then exit)",
        "Ask a running `datastore serve` to drain the calls in flight and exit, "
        "and wait until it has.",
        SHUTDOWN_EPILOG,
    )
    sd.add_argument(
        "--grace",
        type=_grace,
        default=0.0,
        metavar="SECONDS",
        help="how long calls in flight may finish (default: 0, the service's own --grace)",
    )
    sd.add_argument("--reason", default="datastore shutdown", help="logged by the service")
    _client_options(sd, default)


def _seconds_option(
    p: Any, flag: str, field: str, what: str, seconds: Callable[[str], float]
) -> None:
    """Serve's option ``flag SECONDS``, of type ``seconds``, stored as its ServeConfig
    ``field`` (whose default it takes); ``what`` it sets, for the help."""
    help = f"{what} (default: %(default)g)"
    default = SERVE_DEFAULTS[field]
    p.add_argument(flag, dest=field, type=seconds, default=default, metavar="SECONDS", help=help)


def _client_options(p: Any, default: Path, timeout: float | None = 5.0) -> None:
    """The service's address (``--address``, or ``--socket``/``--tcp``), ``--token-file``,
    ``--tls-ca`` and ``--timeout`` of the client commands."""
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--address",
        default=None,
        help="the service: a Unix socket path, unix://PATH or HOST:PORT (default: "
        f"$DATASTORE_ADDRESS, else {default})",
    )
    where.add_argument(
        "--socket", dest="address", type=_socket, metavar="PATH", help="as --address PATH"
    )
    where.add_argument(
        "--tcp", dest="address", type=_tcp, metavar="HOST:PORT", help="as --address HOST:PORT"
    )
    p.add_argument("--token-file", type=_path, default=None, help="the secret for TCP")
    p.add_argument(
        "--tls-ca", type=_path, default=None, help="PEM certificate to check a TLS service against"
    )
    shown = "5; none with --wait" if timeout is None else f"{timeout:g}"
    p.add_argument(
        "--timeout",
        type=_seconds,
        default=timeout,
        metavar="SECONDS",
        help=f"how long to wait for an answer (default: {shown})",
    )


def _socket(path: str) -> str:
    """``--socket PATH``: a Unix socket, whatever its name looks like."""
    from datastore.service.paths import unix_target

    return unix_target(path)


def _path(text: str) -> Path:
    """A path option: never empty (``Path("")`` is the working directory, so
    ``--allow ""`` of an unset variable allowed everything under ``/``)."""
    return Path(path_arg(text))


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None


def _seconds(text: str, most: float = math.inf) -> float:
    """``--timeout``, ``--session-idle``, ``--peer-timeout``: a finite number of seconds > 0
    (0 or NaN would wait for nothing), at most ``most``."""
    value = _number(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text!r}")
    if value > most:
        raise argparse.ArgumentTypeError(f"must be at most {most:g} seconds, got {text!r}")
    return value


def _grace(text: str) -> float:
    """``--grace``: seconds in ``0..MAX_GRACE_S`` (shutdown's 0: the service's own)."""
    value = _number(text)
    if not 0 <= value <= MAX_GRACE_S:
        raise argparse.ArgumentTypeError(f"must be 0..{MAX_GRACE_S:g} seconds, got {text!r}")
    return value


def _tcp(address: str) -> str:
    """``--tcp HOST:PORT``, checked for its port."""
    if ":" not in address:
        raise argparse.ArgumentTypeError(f"wants HOST:PORT, got {address!r}")
    return address


def _whole(least: int, most: float = math.inf) -> Callable[[str], int]:
    """The type of an option that is a whole number ``least..most``."""
    bounds = f">= {least}" if most == math.inf else f"{least}..{most}"

    def whole(text: str) -> int:
        try:
            value: int | None = int(text)
        except ValueError:
            value = None
        if value is None or not least <= value <= most:
            raise argparse.ArgumentTypeError(f"must be a whole number {bounds}, got {text!r}")
        return value

    return whole


def parse_bytes(text: str, option: str) -> int:
    """``"64G"`` -> bytes (K, M, G, T: powers of 1024; a plain number: whole bytes), at
    least 1 (``0.5`` was 0 bytes, refused as "got 0"). Raises ``ValueError`` naming
    ``option``."""
    try:
        return parse_size(text, option, least=1)
    except ValueError as exc:  # (what is wrong with it: not a number, a fraction of a byte)
        units = "a plain number is bytes and K, M, G, T are powers of 1024"
        raise ValueError(f"{exc}; {units}; leave it out for no limit") from None
