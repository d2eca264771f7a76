"""Client processes on the service's node: a session ends when the process that opened it does.

A client sends its ``ClientProcess`` (pid, start time, boot id) with ``OpenSession``
(:func:`this_process`). The service watches that process (:class:`ProcessWatch`) when it is
the one the service sees under that pid: the same boot id (the same kernel, not another node)
and the same start time in ``/proc/PID/stat`` (not a reused pid, not a process of another pid
namespace). It opens a pidfd (``os.pidfd_open``, Linux 5.3+), which becomes readable when the
process ends, however it ends (exit, ``SIGKILL``, a crash); one thread waits on every pidfd.
Where there are no pidfds (older kernels), that thread reads ``/proc/PID/stat`` of the
watched processes every :data:`POLL_S` seconds instead: gone, a zombie, or another start time
is an end. Sessions of a process that is not watched (another node, another pid namespace)
end as before: with ``CloseSession``, or after ``--session-idle`` seconds without a stream.
"""

from __future__ import annotations

import os
import selectors
import threading
from collections.abc import Callable
from pathlib import Path

__all__ = ["POLL_S", "ProcessWatch", "boot_id", "running", "start_ticks", "this_process"]

POLL_S = 0.5
"""How often processes watched without a pidfd are looked at."""


def boot_id() -> str:
    """This kernel's boot id; ``""`` where there is none (not Linux)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` from field 3 (state) on; ``None``: no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses
    fields = stat.rpartition(")")[2].split()
    return fields if len(fields) > 19 else None


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot, ``/proc/PID/stat`` field 22);
    ``None`` if no such process is visible."""
    fields = _stat(pid)
    return None if fields is None else int(fields[19])


def running(pid: int, ticks: int) -> bool:
    """Whether the process ``pid`` that started at ``ticks`` still runs (not a zombie)."""
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X") and int(fields[19]) == ticks


def this_process() -> tuple[int, int, str] | None:
    """``(pid, start ticks, boot id)`` of this process; ``None`` where ``/proc`` lacks them."""
    pid = os.getpid()
    ticks, boot = start_ticks(pid), boot_id()
    return None if ticks is None or not boot else (pid, ticks, boot)


class ProcessWatch:
    """Calls ``on_exit(pid)`` once when a watched process ends (from its own thread).

    Args:
        on_exit: called with the pid of a watched process that ended.
        pidfd: use pidfds where the kernel has them; ``False``: always read ``/proc``.
            Default: ``True``.
    """

    def __init__(self, on_exit: Callable[[int], None], *, pidfd: bool = True) -> None:
        self._on_exit = on_exit
        self._pidfd = pidfd and hasattr(os, "pidfd_open")
        self._boot = boot_id()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._watched: set[int] = set()
        self._polled: dict[int, int] = {}  # pid -> start ticks, watched without a pidfd
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="datastore-watch", daemon=True)
        self._thread.start()

    def watch(self, pid: int, ticks: int, boot: str) -> bool:
        """Watch process ``pid`` if it is the one described; whether it is watched now."""
        if not boot or boot != self._boot or not running(pid, ticks):
            return False
        with self._lock:
            if self._stopped:
                return False
            if pid in self._watched:
                return True
            fd = self._open(pid)
            if fd is not None and start_ticks(pid) != ticks:  # reused before it was opened
                os.close(fd)
                return False
            self._watched.add(pid)
            if fd is None:
                self._polled[pid] = ticks
            else:
                self._selector.register(fd, selectors.EVENT_READ, pid)
        os.write(self._wake_w, b"w")  # the thread picks up the new process
        return True

    def _open(self, pid: int) -> int | None:
        """A pidfd of ``pid``; ``None`` where the kernel has none (then ``/proc`` is read)."""
        if not self._pidfd:
            return None
        try:
            return os.pidfd_open(pid)
        except ProcessLookupError:
            return None  # ended meanwhile: the first look at /proc says so
        except OSError:  # ENOSYS: a kernel without pidfds
            self._pidfd = False
            return None

    def _run(self) -> None:
        while True:
            ended = []
            timeout = POLL_S if self._polled else None
            for key, _ in self._selector.select(timeout):
                if key.data is None:
                    os.read(self._wake_r, 4096)
                    continue
                with self._lock:
                    self._selector.unregister(key.fd)
                    os.close(key.fd)
                    self._watched.discard(key.data)
                ended.append(key.data)
            if self._stopped:
                return
            with self._lock:
                for pid, ticks in list(self._polled.items()):
                    if not running(pid, ticks):
                        del self._polled[pid]
                        self._watched.discard(pid)
                        ended.append(pid)
            for pid in ended:
                self._on_exit(pid)

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
