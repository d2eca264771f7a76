"""Client processes on the service's node: a session ends when the process that opened it does.

A client sends its ``ClientProcess`` (pid, start time, boot id) with ``OpenSession``
(:func:`this_process`). The service watches that process (:class:`ProcessWatch`) when it is
the one the service sees under that pid: the same boot id (the same kernel, not another node)
and the same start time in ``/proc/PID/stat`` (not a reused pid, not a process of another pid
namespace). It opens a pidfd (``os.pidfd_open``, Linux 5.3+), which becomes readable when the
process ends, however it ends (exit, ``SIGKILL``, a crash), and one thread waits on every
pidfd. Sessions of a process that is not watched (another node, no pidfd) end as before: with
``CloseSession``, or after ``--session-idle`` seconds without a stream.
"""

from __future__ import annotations

import os
import selectors
import threading
from collections.abc import Callable
from pathlib import Path

__all__ = ["ProcessWatch", "boot_id", "start_ticks", "this_process"]


def boot_id() -> str:
    """This kernel's boot id; ``""`` where there is none (not Linux)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot, ``/proc/PID/stat`` field 22);
    ``None`` if no such process is visible."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses; fields after the
    # last ")" start at field 3, so field 22 is index 19 of them.
    fields = stat.rpartition(")")[2].split()
    return int(fields[19]) if len(fields) > 19 else None


def this_process() -> tuple[int, int, str] | None:
    """``(pid, start ticks, boot id)`` of this process; ``None`` where ``/proc`` lacks them."""
    pid = os.getpid()
    ticks, boot = start_ticks(pid), boot_id()
    return None if ticks is None or not boot else (pid, ticks, boot)


class ProcessWatch:
    """Calls ``on_exit(pid)`` once when a watched process ends (from its own thread).

    Args:
        on_exit: called with the pid of a watched process that ended.
    """

    def __init__(self, on_exit: Callable[[int], None]) -> None:
        self._on_exit = on_exit
        self._boot = boot_id()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._watched: set[int] = set()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="datastore-watch", daemon=True)
        self._thread.start()

    def watch(self, pid: int, ticks: int, boot: str) -> bool:
        """Watch process ``pid`` if it is the one described; whether it is watched now."""
        if not boot or boot != self._boot or start_ticks(pid) != ticks:
            return False
        with self._lock:
            if self._stopped:
                return False
            if pid in self._watched:
                return True
            try:
                fd = os.pidfd_open(pid)
            except (AttributeError, OSError):  # no pidfd (old kernel, not Linux), or gone
                return False
            if start_ticks(pid) != ticks:  # the pid was reused before the pidfd was opened
                os.close(fd)
                return False
            self._watched.add(pid)
            self._selector.register(fd, selectors.EVENT_READ, pid)
        os.write(self._wake_w, b"w")  # the thread picks up the new pidfd
        return True

    def _run(self) -> None:
        while True:
            for key, _ in self._selector.select():
                if key.data is None:
                    os.read(self._wake_r, 4096)
                    if self._stopped:
                        return
                    continue
                with self._lock:
                    self._selector.unregister(key.fd)
                    os.close(key.fd)
                    self._watched.discard(key.data)
                self._on_exit(key.data)

    def close(self) -> None:
        """Stop watching: no more calls of ``on_exit``; every pidfd is closed. Idempotent."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        os.write(self._wake_w, b"s")
        self._thread.join(5)
        with self._lock:
            for key in list(self._selector.get_map().values()):
                if key.data is not None:
                    os.close(key.fd)
            self._selector.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
