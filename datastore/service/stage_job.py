"""``Stage`` on the server: run ``datastore stage`` in a subprocess and stream its progress.

The stage runs as ``python -m datastore stage SRC... --to DEST --progress-json`` in its own
process group (a single process: MPI launcher variables are removed from its environment), so
the service shares its staging code, its exit codes and its lock: a second stage to the same
DEST while one runs ends at once with exit 1 and the lock's message. Each progress line
becomes a ``StageProgress``; the last message has ``done``, the exit code, the JSON summary and
what the stage printed on stderr.

When the client goes away (``active()`` turns false) the process group gets SIGTERM, then
SIGKILL after 5 s. Staging is atomic and resumable, so a cancelled stage leaves nothing
half-written under a final name, and a later stage of the same sources picks up from there.
A stage outlives a service killed with SIGKILL (it finishes, or is killed with its group).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from datastore.service._pb.v1 import datastore_pb2 as pb
from datastore.service.errors import ServiceError
from datastore.service.paths import checked_path, shown
from staging.cluster import LAUNCH_ENV
from staging.confine import beneath

__all__ = ["KILL_AFTER_S", "landed", "stage_argv", "stream_stage"]

KILL_AFTER_S = 5.0
POLL_S = 0.2


def stage_argv(request: Any, allowed_roots: Sequence[Path | str] = ()) -> list[str]:
    """The ``datastore stage`` command line of a ``StageRequest``, once it is found valid.

    Raises:
        ServiceError: ``INVALID_ARGUMENT`` (no source, a path that is relative, holds a NUL
            byte or is longer than :data:`~datastore.service.paths.MAX_PATH` bytes) or
            ``PERMISSION_DENIED`` (a path outside ``allowed_roots``, when any are given).
    """
    sources, dest = list(request.sources), request.dest
    if not sources:
        raise ServiceError("INVALID_ARGUMENT", "Stage needs at least one source")
    if not dest:
        raise ServiceError("INVALID_ARGUMENT", "Stage needs a destination")
    for p in sources:
        checked_path(p, "a source")
    checked_path(dest, "dest")
    if allowed_roots:
        for p in (*sources, dest):
            if not beneath(p, allowed_roots):
                roots = ", ".join(str(r) for r in allowed_roots)
                raise ServiceError(
                    "PERMISSION_DENIED",
                    f"{shown(p)} is outside the paths this service stages from and to ({roots})",
                )
    if allowed_roots:  # as checked: the stage refuses it if a link leads it out by then
        dest = os.path.realpath(dest)
    argv = [sys.executable, "-m", "datastore", "stage", *sources, "--to", dest]
    argv.append("--progress-json")
    for root in allowed_roots:  # no symlink inside a source may lead out of the roots
        argv += ["--confine", os.fspath(root)]
    if request.verify:
        argv.append("--verify")
    if not request.unpack:
        argv.append("--no-unpack")
    if request.streams:
        argv += ["--streams", str(request.streams)]
    return argv


def landed(sources: Sequence[str], dest: str) -> list[str]:
    """Where a finished stage put its sources, as datasets to make resident: each directory
    source under its own name in ``dest``, and ``dest`` itself for the files and archives that
    land (or are unpacked) straight into it."""
    out: list[str] = []
    for src in sources:
        name = os.path.basename(os.path.abspath(src).rstrip("/"))
        where = os.path.join(dest, name) if os.path.isdir(src) else dest
        if where not in out:
            out.append(where)
    return out


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the stage's process group, SIGKILL if it is still there after 5 s."""
    for sig, wait_s in ((signal.SIGTERM, KILL_AFTER_S), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _read_lines(stream: Any, out: queue.Queue) -> None:
    for line in stream:
        out.put(line)
    out.put(None)


def stream_stage(
    request: Any,
    active: Callable[[], bool],
    allowed_roots: Sequence[Path | str] = (),
) -> Iterator[Any]:
    """Run one stage; yield ``StageProgress`` messages, the last with ``done=True``.

    Args:
        request: the ``StageRequest``.
        active: whether the client still listens (``context.is_active``); once false the
            stage is killed and nothing more is yielded.
        allowed_roots: when given, every source and DEST must lie under one of them.

    Raises:
        ServiceError: an invalid request (before anything runs); see :func:`stage_argv`.
    """
    argv = stage_argv(request, allowed_roots)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
            env=env,
            text=True,
            start_new_session=True,  # its own process group, killed as one
        )
        lines: queue.Queue = queue.Queue()
        reader = threading.Thread(
            target=_read_lines, args=(proc.stdout, lines), name="stage-stdout", daemon=True
        )
        reader.start()
        done, total = 0, 0
        summaries: list[dict[str, Any]] = []
        other: list[str] = []
        finished = False
        try:
            while True:
                try:
                    line = lines.get(timeout=POLL_S)
                except queue.Empty:
                    line = ""
                if not active():
                    return
                if line is None:
                    break
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except ValueError:
                    obj = None
                if isinstance(obj, dict) and obj.get("event") == "progress":
                    # counts of one Progress: monotonic
                    done, total = int(obj["bytes_done"]), int(obj["bytes_total"])
                    yield pb.StageProgress(bytes_done=done, bytes_total=total)
                elif isinstance(obj, dict):
                    summaries.append(obj)
                else:
                    other.append(line.rstrip("\n"))
            code = proc.wait()
            finished = True
        finally:
            if not finished:
                _kill_group(proc)
            reader.join(1.0)
            if proc.stdout is not None:
                proc.stdout.close()
        err.seek(0)
        message = "\n".join([*other, err.read().decode(errors="replace").strip()]).strip()
    yield pb.StageProgress(
        bytes_done=done,
        bytes_total=total,
        done=True,
        exit_code=128 - code if code < 0 else code,  # killed by a signal: as a shell says
        summary_json=json.dumps(_summary(summaries)) if summaries else "",
        message=message,
    )


def _summary(objs: list[dict[str, Any]]) -> dict[str, Any]:
    """The stage's summary; the ``--verify`` result that may follow goes under ``verify``."""
    first = dict(objs[0])
    for obj in objs[1:]:
        first["verify" if "verified" in obj else "more"] = obj
    return first
